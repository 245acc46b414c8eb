#!/bin/bash
# Session 5, run D (experiment 20): paged prefill with the block ids checked once per chunk.
# Variants (carry .exp_v0 .exp_v5 .exp_v6 .exp_v7): v0 main before (per-key checks, 2048-key
# chunks), v5 the new kernel (checks per chunk, 8192-key chunks), v6 checks per chunk with
# 2048-key chunks, v7 with 32768-key chunks. Then GPU tests of the prefill paths, the
# prefill/extend/mixed workloads with the anchors, and the host cost of a TMA launch.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
S=$PWD/scripts/gpu_prefill_sweep.py
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "(prefill or varlen) and not fp16 and not fp32" > $R/t_gpu.log 2>&1; echo "tests rc=$?"; tail -1 $R/t_gpu.log
for v in v0 v5 v6 v7; do
  (cd .exp_$v && PYTHONPATH=. timeout 120 python $S --graph --variants paged --lengths 2048,8192,32768 \
    --configs 128x128x8x3,128x64x8x3 --anchors "" --json $R/paged_$v.json > $R/paged_$v.log 2>&1; echo "paged $v rc=$?")
done
timeout 150 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
timeout 60 python scripts/host_launch_cost.py > $R/host.log 2>&1; echo "host rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/t_gpu.log | grep -E "FAILED|Error" | head -5
for v in v0 v5 v6 v7; do echo "-- $v"; tar xzf r.tgz -O r/paged_$v.log | grep '^| 128'; done
tar xzf r.tgz -O r/pem.md | grep '^|' | cut -c1-200; tar xzf r.tgz -O r/host.log
