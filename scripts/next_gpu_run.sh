#!/bin/bash
# The first GPU run planned for the next session (docs/session-2026-11-29-s5.md): everything
# session 5 landed without a device (no device time was left), in one call (~8 minutes):
# 1. GPU tests: the engine's pinned graph-decode inputs (GraphInputs), plan.update()'s pinned
#    upload (graph capture/replay tests, persistent path), the prefill plan's metadata views
#    (prefill_seqs) and rest tiles, the prefill autotuner (test_prefill_autotune_gpu);
# 2. prefill/extend/mixed with the anchors: mixed was 348 us in s5 run G; prediction with the
#    views (no exiting programs for the 63 decodes' sequences): 280-300 us (perf-notes exp. 23);
# 3. the same workloads with PAGEDATTN_AUTOTUNE=1 (does the tuner find faster tiles than the table?);
# 4. the engine end to end (TPOT at batch 1 was 5.4 ms against a 3.3 ms floor in session 3).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "(graph or persistent or autotune or paged_prefill or features) and not fp16 and not fp32" > $R/t_gpu.log 2>&1 & P1=$!
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py > $R/t_engine.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_engine; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
timeout 120 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings \
  --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
PAGEDATTN_AUTOTUNE=1 timeout 150 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn --no-ceilings \
  --json $R/pem_tuned.json --markdown $R/pem_tuned.md > $R/pem_tuned.log 2>&1; echo "pem tuned rc=$?"
timeout 150 python -m pagedattn bench e2e --json $R/e2e.json --markdown $R/e2e.md > $R/e2e.log 2>&1; echo "e2e rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for f in pem pem_tuned e2e; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-200; done
