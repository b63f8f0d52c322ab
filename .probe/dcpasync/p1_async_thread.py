"""async_save (thread) of a Run mid-window; training continues right after; load and compare."""
import tempfile, json, sys
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from sidestream import MeanMetric, SumMetric, Run
from sidestream.sinks import JsonlSink, read_jsonl

folder = Path(tempfile.mkdtemp())
run = Run([JsonlSink(folder / "run.jsonl")])
train = run.collector(MeanMetric(), prefix="train").bind("cpu")
tot = run.collector(SumMetric(), prefix="tot").bind("cpu")
g = torch.Generator().manual_seed(0)
all_vals = []
pending = []
for step in range(1, 6):
    x = torch.rand(7, generator=g)
    train.metric.update(x); tot.metric.update(x)
    pending.append(x)
    train.schedule_collection(step); tot.schedule_collection(step)
    pending = []
    run.log(step, {"lr": 0.1 * step})
# mid-window updates at the checkpoint
x = torch.rand(5, generator=g)
train.metric.update(x); tot.metric.update(x); pending.append(x)
expect_mean = torch.cat(pending).double().mean().item()
expect_sum = torch.cat(pending).double().sum().item()
mode = sys.argv[1] if len(sys.argv) > 1 else "thread"
kw = {}
if mode == "process":
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
fut = dcp.async_save({"run": run}, checkpoint_id=folder / "ckpt", **kw)
# keep training immediately
for i in range(50):
    y = torch.full((3,), 100.0)
    train.metric.update(y); tot.metric.update(y)
fut.result(timeout=120)
train.schedule_collection(6); tot.schedule_collection(6)
print("close", run.close())

resumed = Run([JsonlSink(folder / "run2.jsonl")])
t2 = resumed.collector(MeanMetric(), prefix="train")
s2 = resumed.collector(SumMetric(), prefix="tot")
dcp.load({"run": resumed}, checkpoint_id=folder / "ckpt")
t2.bind("cpu"); s2.bind("cpu")
t2.schedule_collection(6); s2.schedule_collection(6)
r1 = t2.collect_results(); r2 = s2.collect_results()
print("mean", r1, "expect", expect_mean)
print("sum", r2, "expect", expect_sum)
resumed.close()
lines = read_jsonl(folder / "run.jsonl")
print([(l["stream"], l["step"]) for l in lines])
