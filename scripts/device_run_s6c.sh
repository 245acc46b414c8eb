#!/bin/bash
# Session 6, run C. Before it: scripts/make_snapshot.sh <the commit before short tiles and streams> .exp_prev;
# carry [".exp_prev"]. It runs:
# 1. bf16 GPU tests: short-prefill tiles on every feature, the prefill plan's second stream (caller
#    stream, graph capture), and the paths the two touch (features over MIXED run the eager
#    prefill + rest on two streams), autotune, the engine;
# 2. prefill/extend/mixed and the router mixes: this tree with anchors, .exp_prev, and this tree
#    with PAGEDATTN_OVERLAP=0 (experiments 26-27);
# 3. the paged prefill tile sweep at S=1024/4096 (head 128) and heads 64/256 (where the short rule
#    ends), and the mixed case's parts again.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "(short or streams or paged_prefill or autotune or features or graph) and not fp16 and not fp32" > $R/t_gpu.log 2>&1 & P1=$!
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py \
  -k "(varlen or engine) and not fp16 and not fp32" > $R/t_other.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_other; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
B="python -m pagedattn.bench --no-ceilings"
W=prefill,extend,mixed,prefill-heavy,decode-heavy
timeout 100 $B --workload $W --provider pagedattn,sdpa-cudnn,sdpa-flash --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
(cd .exp_prev && PYTHONPATH=. timeout 60 $B --workload $W --provider pagedattn --json $R/pem_prev.json --markdown $R/pem_prev.md > $R/pem_prev.log 2>&1; echo "pem prev rc=$?")
PAGEDATTN_OVERLAP=0 timeout 60 $B --workload mixed,prefill-heavy,decode-heavy --provider pagedattn --json $R/pem_serial.json --markdown $R/pem_serial.md > $R/pem_serial.log 2>&1; echo "pem serial rc=$?"
S="python scripts/gpu_prefill_sweep.py --variants paged --anchors sdpa-cudnn --graph"
timeout 70 $S --heads 128 --lengths 1024,4096 --configs 128x128x8x3,64x64x4x3 --json $R/sweep128.json > $R/sweep128.log 2>&1; echo "sweep128 rc=$?"
timeout 70 $S --heads 64 --lengths 2048,4096,8192 --configs 128x128x4x3,64x64x4x3 --json $R/sweep64.json > $R/sweep64.log 2>&1; echo "sweep64 rc=$?"
timeout 70 $S --heads 256 --lengths 2048,4096 --configs 128x64x8x2,64x64x8x2,64x64x4x2 --json $R/sweep256.json > $R/sweep256.log 2>&1; echo "sweep256 rc=$?"
timeout 60 python scripts/mixed_breakdown.py --json $R/mixed.json > $R/mixed.log 2>&1; echo "mixed rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/mixed.log | cut -c1-120
for f in sweep128 sweep64 sweep256; do tar xzf r.tgz -O r/$f.log | grep -E '^\| (64|128|256) \|' | cut -c1-120; done
for f in pem pem_prev pem_serial; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-170; done
