#!/bin/bash
# Session 7, run G: after the last host change (tma_usable / q_tiles_fit in the prefill launcher):
# the bf16 GPU tests of the TMA varlen path and the autotuner, then prefill/extend/mixed with the anchors.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "(varlen_tma or autotune) and not fp16 and not fp32" > $R/t.log 2>&1; echo "t rc=$?"
grep -E "FAILED|Error" $R/t.log | head -5; tail -1 $R/t.log
timeout 70 python -m pagedattn.bench --no-ceilings --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash \
  --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/pem.md 2>/dev/null | grep '^|' | cut -c1-170
