import torch, time
torch.set_num_threads(1)
from sidestream.metrics.classification import BinaryAUROCMetric, _cpu_path
from torchmetrics.classification import BinaryAUROC
N=1_000_000; B=10000
g=torch.Generator().manual_seed(0)
s=torch.rand(N,generator=g); t=torch.randint(0,2,(N,),generator=g)
m=BinaryAUROCMetric(B)
stride=B+1; slots=2*stride
scale=torch.tensor([_cpu_path.bin_scale(B)],dtype=torch.float64)
def variant(s,t,chunk=1<<18,lowview=True):
    prod=torch.empty(chunk,dtype=torch.float64); idx=torch.empty(chunk,dtype=torch.int32)
    tl = t.view(torch.int32)[::2] if (lowview and t.dtype==torch.int64) else None
    total=None
    for a in range(0,N,chunk):
        sc=s[a:a+chunk]; n=sc.shape[0]
        p=prod[:n]; ix=idx[:n]
        torch.mul(sc,scale,out=p)
        ix.copy_(p)
        if tl is not None:
            ix.add_(tl[a:a+n],alpha=stride)
        else:
            ix.add_(t[a:a+n].to(torch.int32),alpha=stride)
        c=torch.bincount(ix,minlength=slots)
        total=c if total is None else total.add_(c)
    return _cpu_path.fold_bins(total,2,B)
ref=m._cpu_counts(s.reshape(-1,1),t.reshape(-1,1))
assert torch.equal(variant(s,t),ref), "mismatch"
assert torch.equal(variant(s,t,lowview=False),ref)
tm=BinaryAUROC(thresholds=None,validate_args=False)
fns={"cur":lambda: m._cpu_counts(s.reshape(-1,1),t.reshape(-1,1)),
     "v18":lambda: variant(s,t),"v19":lambda: variant(s,t,1<<19),"v20":lambda: variant(s,t,1<<20),
     "v18nolow":lambda: variant(s,t,lowview=False),
     "upd":lambda: m.update(s,t), "tm":lambda: tm.update(s,t)}
best={k:1e9 for k in fns}
for r in range(9):
    for k,f in fns.items():
        if k=="tm": tm.reset()
        t0=time.perf_counter()
        for _ in range(5): f()
        best[k]=min(best[k],(time.perf_counter()-t0)/5)
for k,v in best.items(): print(f"{k:10s} {v*1e6:8.1f}")
