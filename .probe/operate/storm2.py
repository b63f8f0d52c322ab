"""Spool at cap: sink always down, spool_max_bytes small; then close with timeout."""
import logging, sys, time, collections, tempfile, os, glob
from sidestream import Run
from sidestream.sinks import JsonlSink, read_jsonl
from sidestream.sinks.base import Sink

records = []
class H(logging.Handler):
    def emit(self, r): records.append(r)
root = logging.getLogger(); root.addHandler(H()); root.setLevel(logging.DEBUG)

N = int(sys.argv[1])
MODE = sys.argv[2]
class Down(Sink):
    name = "down"
    def __init__(self): self.got = []
    def open(self, run): pass
    def write(self, report):
        if MODE == "slow":
            time.sleep(0.01); self.got.append(report.step); return
        raise ConnectionError("tracker down")
    def flush(self, timeout=None): return True
    def close(self, timeout=None): return True

d = tempfile.mkdtemp()
sink = Down()
run = Run([sink], spool_dir=d, sink_capacity=64, spool_max_bytes=64*1024, sink_retry_initial_s=0.01, sink_retry_max_s=0.05)
t0 = time.time()
for s in range(1, N + 1):
    run.log(s, {"x": float(s), "y": 2.0})
    if s % 1000 == 0: time.sleep(0.01)
r = run.sink_runners[0]
print("before close", run.sink_status, r.pending, r.dropped, r.spooled_bytes, file=sys.stderr)
ok = run.close(timeout=2)
print("close", ok, "elapsed", round(time.time() - t0, 2), "got", len(sink.got), file=sys.stderr)
print("final status", run.sink_status, r.pending, r.dropped, file=sys.stderr)
print("files", os.listdir(d), file=sys.stderr)
c = collections.Counter((r.name, r.levelname) for r in records)
print(c, file=sys.stderr)
for r in records:
    if r.levelno >= logging.INFO and r.name.startswith("sidestream"):
        print(r.name, r.levelname, r.getMessage()[:600], file=sys.stderr)
