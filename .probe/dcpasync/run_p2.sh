#!/bin/bash
# usage: run_p2.sh mode saveworld loadworld
source /work/main/.probe/dcpasync/env.sh
D=$(mktemp -d)
TR="nice -n 10 timeout 200 /work/main/.venv/bin/torchrun --standalone"
$TR --nproc_per_node $2 p2_dist.py save $D $1 2>&1 | grep -v "UserWarning\|return func" | tail -15
$TR --nproc_per_node $3 p2_dist.py load $D $1 $2 2>&1 | grep -v "UserWarning\|return func" | tail -15
/work/main/.venv/bin/python - "$D" <<'PY'
import json, sys, collections
lines=[json.loads(l) for l in open(sys.argv[1]+"/run.jsonl")]
c=collections.Counter((l["stream"], l["step"]) for l in lines)
print("steps", sorted(c.items()))
print("dups", [k for k,v in c.items() if v>1])
for l in lines:
    if l["step"] in (5,6): print(l["stream"], l["step"], l["values"])
PY
