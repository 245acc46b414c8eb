#!/bin/bash
# Session 6, run A. Before it: scripts/make_snapshot.sh HEAD .exp_dec && (cd .exp_dec && patch -p1 <
# ../docs/exp/decode_pages.patch); carry [".exp_dec"]. It runs:
# 1. GPU tests of what session 5 landed without a device (graph decode staging, plan.update()'s
#    pinned upload, prefill_seqs views, the autotuner) and the engine, in parallel with the bf16
#    split-KV/persistent/feature tests of the decode variant (experiment 24) from inside .exp_dec;
# 2. prefill/extend/mixed with the anchors (experiment 23's prediction: mixed 348 -> 280-300 us);
# 3. the decode grid: main with cuDNN, then the variant (same run, experiment 24).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "(graph or persistent or autotune or paged_prefill or features) and not fp16 and not fp32" > $R/t_gpu.log 2>&1 & P1=$!
timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py > $R/t_engine.log 2>&1 & P2=$!
cp -r tests pyproject.toml .exp_dec/
(cd .exp_dec && PYTHONPATH=. timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "(split_kv or persistent or features or shapes or cache_past or batch_inv) and not fp16 and not fp32" > $R/t_dec.log 2>&1) & P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_engine t_dec; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
timeout 110 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings \
  --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
timeout 90 python -m pagedattn.bench --workload decode --provider pagedattn,sdpa-cudnn --no-ceilings --json $R/dec_cur.json --markdown $R/dec_cur.md > $R/dec_cur.log 2>&1; echo "dec cur rc=$?"
(cd .exp_dec && PYTHONPATH=. timeout 80 python -m pagedattn.bench --workload decode --provider pagedattn \
  --no-ceilings --json $R/dec_var.json --markdown $R/dec_var.md > $R/dec_var.log 2>&1; echo "dec var rc=$?")
cd $OUT && tar czf r.tgz r && rm -rf r
for f in pem dec_cur dec_var; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-200; done
