#!/bin/bash
# Session 6, run B. Before it: scripts/make_snapshot.sh <commit before the run's kernel edits> .exp_prev;
# .exp_pers = the working tree's package with the persistent kernel's PAGE_WORK_HOISTED False;
# carry [".exp_prev", ".exp_pers"]. It runs:
# 1. bf16 GPU tests of the decode kernels (PAGE_WORK_HOISTED in the 2D and persistent kernels) and
#    of the prefill kernel (its grid in longest-first order), and the engine;
# 2. prefill/extend/mixed: this tree, .exp_prev (same run), and this tree with PAGEDATTN_AUTOTUNE=1;
# 3. the decode grid: 2D/split (auto) and persistent, this tree with cuDNN; persistent of .exp_pers;
# 4. the mixed case's parts (scripts/mixed_breakdown.py), paged prefill tiles at S=512-8192 in the
#    new launch order (the sweep, graph replays), and the engine end to end.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 230 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "(features or shapes or cache_past or split_kv or persistent or batch_inv or graph) and not fp16 and not fp32" > $R/t_dec.log 2>&1 & P1=$!
timeout 230 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py tests/test_gpu_mla.py \
  -k "(varlen or paged_prefill or autotune or engine or prefill) and not fp16 and not fp32" > $R/t_pre.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_dec t_pre; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
B="python -m pagedattn.bench --no-ceilings"
timeout 90 $B --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
(cd .exp_prev && PYTHONPATH=. timeout 60 $B --workload prefill,extend,mixed --provider pagedattn --json $R/pem_prev.json --markdown $R/pem_prev.md > $R/pem_prev.log 2>&1; echo "pem prev rc=$?")
PAGEDATTN_AUTOTUNE=1 timeout 100 $B --workload prefill,extend,mixed --provider pagedattn --json $R/pem_tuned.json --markdown $R/pem_tuned.md > $R/pem_tuned.log 2>&1; echo "pem tuned rc=$?"
timeout 90 $B --workload decode --provider pagedattn,pagedattn-persistent,sdpa-cudnn --json $R/dec.json --markdown $R/dec.md > $R/dec.log 2>&1; echo "dec rc=$?"
(cd .exp_pers && PYTHONPATH=. timeout 60 $B --workload decode --provider pagedattn-persistent --json $R/dec_pers.json --markdown $R/dec_pers.md > $R/dec_pers.log 2>&1; echo "dec pers rc=$?")
timeout 60 python scripts/mixed_breakdown.py --json $R/mixed.json > $R/mixed.log 2>&1; echo "mixed rc=$?"
timeout 80 python scripts/gpu_prefill_sweep.py --lengths 512,2048,8192 --configs 128x128x8x3,128x64x8x3,64x64x4x3,64x128x4x3 \
  --variants paged --anchors "" --graph --json $R/sweep.json > $R/sweep.log 2>&1; echo "sweep rc=$?"
timeout 120 python -m pagedattn bench e2e --json $R/e2e.json --markdown $R/e2e.md > $R/e2e.log 2>&1; echo "e2e rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/mixed.log | cut -c1-120; tar xzf r.tgz -O r/sweep.log | grep '^| 128 |' | cut -c1-150
for f in pem pem_prev pem_tuned dec dec_pers e2e; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-160; done
