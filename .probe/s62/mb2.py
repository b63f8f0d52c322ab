import torch, time
torch.set_num_threads(1)
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification import BinaryAUROCMetric
from torchmetrics.classification import BinaryAUROC
N=1_000_000; B=10000
g=torch.Generator().manual_seed(0)
s=torch.rand(N,generator=g); t=torch.randint(0,2,(N,),generator=g)
def bench(name,fn,reps=30):
    for _ in range(3): fn()
    best=1e9
    for r in range(7):
        t0=time.perf_counter()
        for _ in range(reps): fn()
        best=min(best,(time.perf_counter()-t0)/reps)
    print(f"{name:40s} {best*1e6:9.1f} us")
bench("outside s", lambda: _cpu_path.outside(s,0,1))
bench("outside t", lambda: _cpu_path.outside(t,0,1))
m=BinaryAUROCMetric(B)
bench("cpu_counts", lambda: m._cpu_counts(s.reshape(-1,1),t.reshape(-1,1)))
bench("ours binned", lambda: m.update(s,t))
tm=BinaryAUROC(thresholds=None,validate_args=False)
bench("tm exact", lambda: tm.update(s,t)); tm.reset()
t8=t.to(torch.int8)
bench("ours binned int8 t", lambda: m.update(s,t8))
bench("tm exact int8", lambda: tm.update(s,t8)); tm.reset()
