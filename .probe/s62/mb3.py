import torch, time
torch.set_num_threads(1)
N=1<<18; B=10000
g=torch.Generator().manual_seed(0)
s=torch.rand(N,generator=g); t=torch.randint(0,2,(N,),generator=g)
p=torch.empty(N,dtype=torch.float64); ix=torch.empty(N,dtype=torch.int32); fl=torch.empty(N,dtype=torch.int32)
def bench(name,fn,reps=200):
    for _ in range(3): fn()
    best=1e9
    for r in range(7):
        t0=time.perf_counter()
        for _ in range(reps): fn()
        best=min(best,(time.perf_counter()-t0)/reps)
    print(f"{name:40s} {best*1e6*4:9.1f} us per 1M")
bench("p.copy_(s)", lambda: p.copy_(s))
bench("p.mul_", lambda: p.mul_(1.0001))
bench("ix.copy_(p)", lambda: ix.copy_(p))
bench("fl.copy_(t)", lambda: fl.copy_(t))
bench("ix.add_(fl,alpha)", lambda: ix.add_(fl,alpha=10001))
bench("ix.add_(t,alpha) int64", lambda: ix.add_(t,alpha=10001))
bench("bincount", lambda: torch.bincount(ix.clamp(0,20001),minlength=20002))
bench("torch.mul(s,scale,out=p)", lambda: torch.mul(s.double(),1.0,out=p))
bench("p.copy_(s).mul_", lambda: p.copy_(s).mul_(1.0001))
bench("s.view(int32).aminmax", lambda: torch.aminmax(s.view(torch.int32)))
bench("t uint8 amax + amax", lambda: (t.view(torch.uint8).amax(), t.amax()))
bench("fused addcmul f64", lambda: torch.addcmul(p, fl, torch.tensor(3.0,dtype=torch.float64), out=p) )
