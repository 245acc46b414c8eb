#!/bin/bash
# Session 7, run E: the GPU tests run D's timeout cut off (the last 33 of tests/test_gpu.py: paged
# prefill, the prefill-and-rest streams test that delays both streams, autotune, short tiles), and
# the autotuner again with a sleep queued ahead of each timed call (time_call), with its choices.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
T="python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py"
timeout 200 $T -k "(streams or autotune) and not fp16 and not fp32" > $R/t_a.log 2>&1 & P1=$!
timeout 200 $T -k "paged_prefill and not fp16 and not fp32" > $R/t_b.log 2>&1 & P2=$!
timeout 200 $T -k "short and not fp16 and not fp32" > $R/t_c.log 2>&1 & P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$?"; done
for f in t_a t_b t_c; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
PAGEDATTN_AUTOTUNE=1 timeout 90 python -m pagedattn.bench --no-ceilings --workload prefill,extend,mixed --provider pagedattn \
  --json $R/pem_tuned.json --markdown $R/pem_tuned.md > $R/pem_tuned.log 2>&1; echo "tuned rc=$?"
PAGEDATTN_AUTOTUNE=1 timeout 60 python scripts/tune_choices.py > $R/choices.log 2>&1; echo "choices rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/choices.log | cut -c1-250
tar xzf r.tgz -O r/pem_tuned.md 2>/dev/null | grep '^|' | cut -c1-170
