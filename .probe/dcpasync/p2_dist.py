"""2 gloo ranks: model+optim (get_state_dict) + Run in one app_state; async_save while windows in flight.

phase save: ranks train; at step 5 async_save; keep training (and scheduling windows) while upload runs.
phase load: fresh ranks (any world size) load into a fresh tree; one more window; compare to direct.
"""
import json, os, sys, time
from pathlib import Path
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from sidestream import MeanMetric, SumMetric, MaxMetric, Run
from sidestream.sinks import JsonlSink, read_jsonl

phase, folder, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

class App(Stateful):
    def __init__(self, model, optim):
        self.model, self.optim = model, optim
    def state_dict(self):
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}
    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

def data(step, r):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.rand(4 + r, generator=g)

model = torch.nn.Linear(3, 1)
optim = torch.optim.Adam(model.parameters(), lr=0.1)
run = Run([JsonlSink(folder / "run.jsonl")])
mean = run.collector(MeanMetric(), prefix="train")
mx = run.collector(MaxMetric(), prefix="max")
app = App(model, optim)
if phase == "save":
    mean.bind("cpu"); mx.bind("cpu")
    ckpt_pg = dist.new_group(backend="gloo")
    fut = None
    for step in range(1, 11):
        x = data(step, rank)
        mean.metric.update(x); mx.metric.update(x)
        loss = model(torch.ones(1, 3)).sum() ** 2
        loss.backward(); optim.step(); optim.zero_grad()
        if step == 5:
            # mid-window: 5 updated, schedule after the checkpoint? docs say schedule first.
            mean.schedule_collection(step); mx.schedule_collection(step)
            run.log(step, {"lr": 0.1})
            x = data(99, rank)  # mid-window data at the checkpoint
            mean.metric.update(x); mx.metric.update(x)
            kw = {}
            if mode == "process":
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
                kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
            if mode == "sync":
                dcp.save({"app": app, "run": run}, checkpoint_id=folder / "ckpt")
            else:
                fut = dcp.async_save({"app": app, "run": run}, checkpoint_id=folder / "ckpt",
                                     process_group=ckpt_pg, **kw)
            # record model params at checkpoint
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, folder / f"model{rank}.pt")
            continue
        mean.schedule_collection(step); mx.schedule_collection(step)
        run.log(step, {"lr": 0.1})
    if fut is not None:
        fut.result(timeout=120)
    print(rank, "close", run.close(), flush=True)
else:
    dcp.load({"app": app, "run": run}, checkpoint_id=folder / "ckpt")
    ref = torch.load(folder / "model0.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), (k, v, ref[k])
    mean.bind("cpu"); mx.bind("cpu")
    save_world = int(sys.argv[4])
    # window 6 on resume: saved mid-window data of all save ranks + new data on this world
    x = data(6, rank)
    mean.metric.update(x); mx.metric.update(x)
    mean.schedule_collection(6); mx.schedule_collection(6)
    run.log(6, {"lr": 0.2})
    r_mean = mean.collect_results(); r_max = mx.collect_results()
    allx = torch.cat([data(99, r) for r in range(save_world)] + [data(6, r) for r in range(world)]).double()
    print(rank, "mean", float(r_mean), "expect", allx.mean().item(), "max", float(r_max), allx.max().item(), flush=True)
    assert abs(float(r_mean) - allx.mean().item()) < 1e-6
    assert abs(float(r_max) - allx.max().item()) < 1e-6
    print(rank, "close", run.close(), flush=True)
dist.destroy_process_group()
