#!/bin/bash
# Session 5, run E (experiment 20, second step): paged prefill address math. Variants (carry
# .exp_v6 .exp_v8 .exp_v9): v6 per-key page and slot math (run D's kernel), v8 slots hoisted out
# of the tile loop and one gather per key (main), v9 one gather per page broadcast to its keys.
# Each also runs the extend and mixed workloads; then the host cost of a TMA launch.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
S=$PWD/scripts/gpu_prefill_sweep.py
for v in v6 v8 v9; do
  (cd .exp_$v && PYTHONPATH=. timeout 120 python $S --graph --variants paged --lengths 2048,8192,32768 \
    --configs 128x128x8x3,128x64x8x3 --anchors "" --json $R/paged_$v.json > $R/paged_$v.log 2>&1; echo "paged $v rc=$?"
   PYTHONPATH=. timeout 60 python -m pagedattn.bench --workload extend,mixed --provider pagedattn --no-ceilings \
    --json $R/em_$v.json --markdown $R/em_$v.md > $R/em_$v.log 2>&1; echo "em $v rc=$?")
done
timeout 60 python scripts/host_launch_cost.py > $R/host.log 2>&1; echo "host rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for v in v6 v8 v9; do echo "-- $v"; tar xzf r.tgz -O r/paged_$v.log | grep '^| 128'; tar xzf r.tgz -O r/em_$v.md | grep '^| [em]'; done
tar xzf r.tgz -O r/host.log
