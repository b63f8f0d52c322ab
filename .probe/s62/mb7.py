import torch, time
torch.set_num_threads(1)
from sidestream.metrics.classification import BinaryAUROCMetric
N=1_000_000; B=10000
g=torch.Generator().manual_seed(0)
s=torch.rand(N,generator=g); t=torch.randint(0,2,(N,),generator=g)
m=BinaryAUROCMetric(B)
for _ in range(5): m.update(s,t)
from torch.profiler import profile
with profile() as p:
    for _ in range(20): m.update(s,t)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
