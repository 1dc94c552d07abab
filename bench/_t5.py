import json, tempfile, sys, time
from pathlib import Path
from bench.workloads import Keys, Sizes, presign
from bench.reticulum import run_reticulum
if __name__ == "__main__":
    root = Path(tempfile.mkdtemp(prefix="ub-", dir="/tmp"))
    keys = Keys.generate(); sizes = Sizes(warm=100, n_max=2000, lat_seconds=2)
    p = presign("uni", keys, sizes, root/"uni.pkl")
    t=time.time()
    r = run_reticulum(root, 1, sizes, p)
    print(time.time()-t)
    print(json.dumps(r, indent=1)[:4000])
    print(open(root/"reticulum"/"rnsd.log").read()[-2000:])
