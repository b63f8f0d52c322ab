import torch, time
torch.set_num_threads(1)
from torchmetrics.classification import BinaryAUROC
from sidestream.metrics.classification import BinaryAUROCMetric
N=1_000_000; B=10000
g=torch.Generator().manual_seed(0)
s=torch.rand(N,generator=g); t=torch.randint(0,2,(N,),generator=g)
def bench(name,fn,reps=30):
    for _ in range(3): fn()
    best=1e9
    for r in range(5):
        t0=time.perf_counter()
        for _ in range(reps): fn()
        best=min(best,(time.perf_counter()-t0)/reps)
    print(f"{name:40s} {best*1e6:9.1f} us")
idx64=(s*B).long().clamp_(max=B-1); idx32=idx64.int()
bench("bincount int64", lambda: torch.bincount(idx64,minlength=2*B))
bench("bincount int32", lambda: torch.bincount(idx32,minlength=2*B))
bench("histc", lambda: torch.histc(s,bins=B,min=0,max=1))
x2=s+2*t
bench("histc 3B", lambda: torch.histc(x2,bins=3*B,min=0,max=3))
bench("mul+to int32", lambda: (s*B).to(torch.int32))
bench("aminmax s", lambda: torch.aminmax(s))
bench("aminmax t", lambda: torch.aminmax(t))
bench("index_add_", lambda: torch.zeros(2*B,dtype=torch.int64).index_add_(0,idx64,torch.ones((),dtype=torch.int64).expand(N)))
h=torch.zeros(2*B,dtype=torch.int64)
bench("index_put_ accumulate", lambda: h.index_put_((idx64,),torch.ones((),dtype=torch.int64).expand(N),accumulate=True))
import numpy as np
a=idx32.numpy(); hn=np.zeros(2*B,np.int64)
bench("np.bincount", lambda: np.bincount(a,minlength=2*B))
bench("np.add.at", lambda: np.add.at(hn,a,1))
tm=BinaryAUROC(thresholds=None,validate_args=False)
bench("tm exact", lambda: tm.update(s,t)); tm.reset()
m=BinaryAUROCMetric(B)
bench("ours binned", lambda: m.update(s,t))
