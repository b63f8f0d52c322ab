"""A sink raising on every write for N steps, then recovering. Count log records."""
import logging, sys, time, io, collections, warnings, json, tempfile, os
from sidestream import Run, SumMetric
from sidestream.sinks import JsonlSink, read_jsonl
from sidestream.sinks.base import Sink

records = []
class H(logging.Handler):
    def emit(self, r): records.append(r)
root = logging.getLogger(); root.addHandler(H()); root.setLevel(logging.DEBUG)
warnings.simplefilter("always")
wlist = []
import warnings as w
old = w.showwarning
w.showwarning = lambda *a, **k: wlist.append(a)

N = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
class Flaky(Sink):
    name = "flaky"
    def __init__(self): self.down = True; self.got = []
    def open(self, run): pass
    def write(self, report):
        if self.down: raise ConnectionError("tracker down")
        self.got.append(report.step)
    def flush(self, timeout=None): return True
    def close(self, timeout=None): return True

d = tempfile.mkdtemp()
sink = Flaky()
run = Run([sink, JsonlSink(f"{d}/ok.jsonl")], spool_dir=d, sink_retry_initial_s=0.01, sink_retry_max_s=0.05)
t0 = time.time()
for s in range(1, N + 1):
    run.log(s, {"x": float(s)})
    if s % 2000 == 0:
        print("status", s, run.sink_status, [(r.key, r.pending, r.dropped, r.spooled_bytes) for r in run.sink_runners], file=sys.stderr)
sink.down = False
ok = run.close(timeout=60)
print("close", ok, "elapsed", time.time() - t0, "got", len(sink.got), "jsonl", len(list(read_jsonl(f"{d}/ok.jsonl"))), file=sys.stderr)
print("final status", run.sink_status, file=sys.stderr)
c = collections.Counter((r.name, r.levelname) for r in records)
print(c, file=sys.stderr)
for r in records:
    if r.levelno >= logging.INFO and r.name.startswith("sidestream"):
        print(r.name, r.levelname, r.getMessage()[:300], file=sys.stderr)
print("warnings", len(wlist), file=sys.stderr)
