import torch, time, sys
from benchmarks import update_overhead as u
from benchmarks._threads import one_thread
torch.set_num_threads(1)
if True:
    cases=u._cases(1_000_000)
    name=[n for n in cases if n.startswith("BinaryAUROC (")][0]
    c=cases[name]
    impl={"raw":c.raw,"ours":lambda: c.ours(*c.args),"tm":c.peer}
    if len(sys.argv)>1: impl={k:v for k,v in impl.items() if k in sys.argv[1].split(",")}
    print(u._best_us(impl,{"tm":c.peer_reset},1_000_000))
