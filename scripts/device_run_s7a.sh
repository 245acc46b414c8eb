#!/bin/bash
# Session 7, run A. Before it: scripts/make_snapshot.sh HEAD .exp_p32 && cp -r tests pyproject.toml .exp_p32/
# && apply docs/exp/prefill_int32.patch inside it (experiment 29; its kernel hunk re-based by hand
# on page_of_tile_keys). carry [".exp_p32"]. It runs:
# 1. .exp_p32's bf16 GPU tests of the prefill paths (varlen, paged prefill, short tiles, big cache);
# 2. prefill/extend/mixed, this tree and .exp_p32 alternating twice;
# 3. the paged tile sweep at S=8192 on .exp_p32 (int32 offsets free registers: do other tiles win now?).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
(cd .exp_p32 && PYTHONPATH=. timeout 170 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "(varlen or cache_past) and not fp16 and not fp32" > $R/t_p32a.log 2>&1) & P1=$!
(cd .exp_p32 && PYTHONPATH=. timeout 170 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "(paged_prefill or short) and not fp16 and not fp32" > $R/t_p32b.log 2>&1) & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_p32a t_p32b; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
P="python -m pagedattn.bench --no-ceilings --workload prefill,extend,mixed --provider pagedattn"
for i in 1 2; do
  timeout 55 $P --json $R/pem_cur$i.json --markdown $R/pem_cur$i.md > $R/pem_cur$i.log 2>&1; echo "cur $i rc=$?"
  (cd .exp_p32 && PYTHONPATH=. timeout 55 $P --json $R/pem_p32$i.json --markdown $R/pem_p32$i.md > $R/pem_p32$i.log 2>&1; echo "p32 $i rc=$?")
done
(cd .exp_p32 && PYTHONPATH=. timeout 80 python ../scripts/gpu_prefill_sweep.py --variants paged --anchors sdpa-cudnn --graph \
  --heads 128 --lengths 8192 --configs 128x128x8x3,128x128x8x2,128x64x8x3,128x64x8x4 --json $R/sweep.json > $R/sweep.log 2>&1; echo "sweep rc=$?")
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/sweep.log | grep -E '^\| (64|128|256) \|' | cut -c1-120
for f in pem_cur1 pem_p321 pem_cur2 pem_p322; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-150; done
