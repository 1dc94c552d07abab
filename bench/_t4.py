import json, tempfile, sys, time
from pathlib import Path
from bench.workloads import Keys, Sizes, presign
from bench import peers
if __name__ == "__main__":
    root = Path(tempfile.mkdtemp(prefix="ub-", dir="/tmp"))
    keys = Keys.generate(); sizes = Sizes(warm=300, n_max=5000, lat_seconds=2)
    p = presign("uni", keys, sizes, root/"uni.pkl")
    for system in sys.argv[2:]:
        t=time.time()
        r = peers.run_broker(root, system, int(sys.argv[1]), sizes, p)
        print(system, time.time()-t)
        for k in ("max","latency"):
            v = r.get(k, {})
            print(k, v.get("msgs_per_s"), v.get("deliveries_per_s"), v.get("loss"), (v.get("receiver") or {}).get("latency"), v.get("publisher",{}).get("error"), v.get("receiver",{}).get("error"))
        print(r.get("error"), r.get("warmup",{}).get("loss"))
