#!/bin/bash
# Session 7, run F: the autotuner with the L2 flushed before each timed call (time_call): its GPU
# tests, its choices (scripts/tune_choices.py) and prefill/extend/mixed with it on.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "autotune and not fp16 and not fp32" > $R/t_a.log 2>&1; echo "t rc=$?"
grep -E "FAILED|Error" $R/t_a.log | head -5; tail -1 $R/t_a.log
PAGEDATTN_AUTOTUNE=1 timeout 60 python scripts/tune_choices.py > $R/choices.log 2>&1; echo "choices rc=$?"
PAGEDATTN_AUTOTUNE=1 timeout 90 python -m pagedattn.bench --no-ceilings --workload prefill,extend,mixed --provider pagedattn \
  --json $R/pem_tuned.json --markdown $R/pem_tuned.md > $R/pem_tuned.log 2>&1; echo "tuned rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/choices.log | sed -E 's/.*(, [0-9]+, 32, 1, Tiles)/\1/' | cut -c1-200
tar xzf r.tgz -O r/pem_tuned.md 2>/dev/null | grep '^|' | cut -c1-170
