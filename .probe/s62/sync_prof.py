import time, statistics, cProfile, pstats, io
import torch, torch.distributed as dist
from benchmarks import sync_cost as sc
from benchmarks._bare import bare_all_gather
from sidestream.testing import DistributedPool

def body():
    torch.manual_seed(dist.get_rank())
    m = sc.sidestream_collection()
    parts=[m]
    import benchmarks.schedule_cost as sch
    sch._update(parts, 1)
    m.sync(); m.sync()
    arena = m.__dict__.get("_state_arena")
    n = 1504
    send=torch.zeros(n,dtype=torch.uint8); got=torch.empty(n*dist.get_world_size(),dtype=torch.uint8)
    tcpu={"ss":[], "bare":[]}; twall={"ss":[], "bare":[]}
    for i in range(200):
        for k in ("ss","bare"):
            dist.barrier()
            w0=time.perf_counter(); c0=time.thread_time()
            if k=="ss": m.sync()
            else: bare_all_gather(got,send).wait()
            tcpu[k].append(time.thread_time()-c0); twall[k].append(time.perf_counter()-w0)
    prof=cProfile.Profile()
    for i in range(50):
        dist.barrier(); prof.enable(); m.sync(); prof.disable()
    s=io.StringIO(); pstats.Stats(prof,stream=s).sort_stats("tottime").print_stats(18)
    return {k:(statistics.median(tcpu[k])*1e6, statistics.median(twall[k])*1e6) for k in tcpu}, s.getvalue()

if __name__=="__main__":
    with DistributedPool(4) as pool:
        r=pool.run(body, timeout=300)
    print(r[0][0]); print(r[0][1][:5000])
