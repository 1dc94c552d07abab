import json, tempfile
from pathlib import Path
from bench.workloads import Keys, Sizes, presign, load_sample
from bench import ceilings
if __name__ == "__main__":
    root = Path(tempfile.mkdtemp(prefix="ub-", dir="/tmp"))
    keys = Keys.generate(); sizes = Sizes(warm=300, n_max=2000, lat_seconds=1)
    p = presign("uni", keys, sizes, root/"uni.pkl")
    print(json.dumps(ceilings.run(load_sample(p), True), indent=1))
