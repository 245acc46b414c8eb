#!/bin/bash
# Session 5, run G: the prefill plan's unified launch sized for the sequences it serves
# (rest_max_query_len: decode tiles for a prefill among decodes, no launch for prefill only).
# GPU tests of the paths that run it (every paged_attention test over MIXED uses the prefill
# path for its 129- and 300-query rows; the engine tests), then prefill/extend/mixed with anchors.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 230 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_engine.py \
  -k "(features or shapes or paged_prefill or graph or engine) and not fp16 and not fp32" > $R/t_gpu.log 2>&1; echo "tests rc=$?"; tail -1 $R/t_gpu.log
timeout 120 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/t_gpu.log | grep -E "FAILED|Error" | head -8
tar xzf r.tgz -O r/pem.md | grep '^|' | cut -c1-200
