#!/bin/bash
# Session 7, run D: the final tree. It runs
# 1. the full bf16 GPU suite (tests/test_gpu.py, MLA, engine): covers session 6's unrun review fixes
#    (side-stream join in finally, per-thread streams, grid-limit check, the delayed-stream test)
#    and this session's prefill changes (int32 offsets, the TMA loop split, raw scores on 64-row tiles);
# 2. the report table: prefill/extend/mixed/router mixes with cuDNN and FA2 from the same run;
# 3. heads 64 and 256 (default tiles, paged) against cuDNN and FA2 at S=2048/8192;
# 4. the autotuner (PAGEDATTN_AUTOTUNE=1) on prefill/extend/mixed, with its interleaved timing rounds.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 290 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not fp16 and not fp32" > $R/t_gpu.log 2>&1 & P1=$!
timeout 290 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_mla.py tests/test_gpu_engine.py > $R/t_other.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_other; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
B="python -m pagedattn.bench --no-ceilings"
timeout 100 $B --workload prefill,extend,mixed,prefill-heavy,decode-heavy --provider pagedattn,sdpa-cudnn,sdpa-flash \
  --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
S="python scripts/gpu_prefill_sweep.py --variants paged --anchors sdpa-cudnn,sdpa-flash --graph --configs default"
timeout 60 $S --heads 64,256 --lengths 2048,8192 --json $R/heads.json > $R/heads.log 2>&1; echo "heads rc=$?"
PAGEDATTN_AUTOTUNE=1 timeout 90 $B --workload prefill,extend,mixed --provider pagedattn --json $R/pem_tuned.json \
  --markdown $R/pem_tuned.md > $R/pem_tuned.log 2>&1; echo "tuned rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/heads.log | grep -E '^\| (64|128|256) \|' | cut -c1-120
for f in pem pem_tuned; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-170; done
