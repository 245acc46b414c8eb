#!/bin/bash
# Session 7, run B. Before it: scripts/make_snapshot.sh b6ad94f .exp_i32 (int32 offsets, scores formed);
# .exp_lazy = HEAD with lazy rescaling of the mask-free tiles (the accumulator rescaled only when
# some row's max grows by more than 8, a CTA-wide max a tile). carry [".exp_i32", ".exp_lazy"]. It runs:
# 1. bf16 GPU tests of this tree's prefill paths (raw-score softmax, experiment 30);
# 2. prefill/extend/mixed: .exp_i32, this tree, .exp_lazy, alternating twice;
# 3. the paged tile sweep at S=2048/8192 on this tree: 128x128 w8 s3 against 64x64 w4 s3.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
T="python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py"
timeout 250 $T -k "(varlen or cache_past) and not fp16 and not fp32" > $R/t_a.log 2>&1 & P1=$!
timeout 250 $T -k "paged_prefill and not fp16 and not fp32" > $R/t_b.log 2>&1 & P2=$!
timeout 250 $T -k "short and not fp16 and not fp32" > $R/t_c.log 2>&1 & P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$?"; done
for f in t_a t_b t_c; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
P="python -m pagedattn.bench --no-ceilings --workload prefill,extend,mixed --provider pagedattn"
for i in 1 2; do
  (cd .exp_i32 && PYTHONPATH=. timeout 50 $P --json $R/pem_i32_$i.json --markdown $R/pem_i32_$i.md > $R/pem_i32_$i.log 2>&1; echo "i32 $i rc=$?")
  timeout 50 $P --json $R/pem_cur_$i.json --markdown $R/pem_cur_$i.md > $R/pem_cur_$i.log 2>&1; echo "cur $i rc=$?"
  (cd .exp_lazy && PYTHONPATH=. timeout 50 $P --json $R/pem_lazy_$i.json --markdown $R/pem_lazy_$i.md > $R/pem_lazy_$i.log 2>&1; echo "lazy $i rc=$?")
done
timeout 80 python scripts/gpu_prefill_sweep.py --variants paged --anchors sdpa-cudnn --graph \
  --heads 128 --lengths 2048,8192 --configs 128x128x8x3,64x64x4x3 --json $R/sweep.json > $R/sweep.log 2>&1; echo "sweep rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/sweep.log | grep -E '^\| (64|128|256) \|' | cut -c1-120
for f in pem_i32_1 pem_cur_1 pem_lazy_1 pem_i32_2 pem_cur_2 pem_lazy_2; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^| [pem]' | cut -c1-150; done
