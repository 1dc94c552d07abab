import time, tempfile, sys, socket
from pathlib import Path
from bench.workloads import Keys
from bench.ours import start_daemon
from bench.clients import UpsycleApp, upsycle_packet
from bench.common import body, pin
from upsycle_router.crypto import sign_message
from upsycle_router.wire.messages import UnicastHeader
from upsycle_router.expiry import exp_in
import struct
if __name__ == "__main__":
    root = Path(tempfile.mkdtemp(prefix="ub-", dir="/tmp"))
    keys = Keys.generate()
    pinned = sys.argv[1] == "pin"
    d = start_daemon(root, "a", keys.router_a, "none", cpu={0} if pinned else {0,1})
    pin({1})
    r = UpsycleApp(str(d.sock), keys.receivers[0]); p = UpsycleApp(str(d.sock), keys.publisher)
    exp = exp_in(time.time(), 86400)
    msgs = [upsycle_packet(sign_message(UnicastHeader(keys.publisher.public, keys.receivers[0].public, 3600, exp), body(5, i, 0, keys.tag), keys.publisher).encode()) for i in range(2000)]
    lats = []
    r.sock.settimeout(2)
    interval = float(sys.argv[2])
    for i, m in enumerate(msgs):
        t = time.monotonic_ns()
        p.sock.sendall(m)
        got = 0; buf = b""
        while len(buf) < len(m):
            buf += r.sock.recv(65536)
        lats.append((time.monotonic_ns() - t) / 1e6)
        time.sleep(interval)
    lats2 = sorted(lats)
    print("p50 %.3f p99 %.3f max %.3f" % (lats2[len(lats)//2], lats2[int(len(lats)*0.99)], lats2[-1]))
    print([round(x,2) for x in lats[:40]])
    d.child.stop()
