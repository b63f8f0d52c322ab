import torch, time, sys
torch.set_num_threads(1)
from sidestream.metrics.classification import BinaryAUROCMetric
N=1_000_000; B=10000
g=torch.Generator().manual_seed(0)
s=torch.rand(N,generator=g); t=torch.randint(0,2,(N,),generator=g)
m=BinaryAUROCMetric(B)
for reps in (1,3,30):
    best=1e9
    for r in range(7):
        t0=time.perf_counter()
        for _ in range(reps): m.update(s,t)
        best=min(best,(time.perf_counter()-t0)/reps)
    print(reps, f"{best*1e6:9.1f} us")
