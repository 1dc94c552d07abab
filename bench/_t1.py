import json, tempfile, time, sys
from pathlib import Path
from bench.workloads import Keys, Sizes, presign
from bench.ours import run_scenario
if __name__ == "__main__":
    root = Path(tempfile.mkdtemp(prefix="ub-", dir="/tmp"))
    keys = Keys.generate(); sizes = Sizes(warm=300, n_max=5000, lat_seconds=2)
    t=time.time()
    msgs = {"uni": presign("uni", keys, sizes, root/"uni.pkl"), "mc": presign("mc", keys, sizes, root/"mc.pkl")}
    print("presign", time.time()-t)
    dur = sys.argv[1]
    for name in sys.argv[2:]:
        t=time.time()
        r = run_scenario(root, name, dur, keys, sizes, msgs)
        print(name, round(time.time()-t,1))
        for k in ("warmup", "max","latency"):
            v = r.get(k, {})
            print(" ", k, v.get("msgs_per_s"), v.get("deliveries_per_s"), v.get("loss"), v.get("server_cpu_us_per_msg"), (v.get("receiver") or {}).get("latency"), v.get("publisher",{}).get("error"), v.get("receiver",{}).get("error"))
        print(" ", r.get("error"), r.get("warnings"))
