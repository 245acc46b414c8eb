#!/bin/bash
# The second GPU run planned for the next session: the full bf16 GPU suite once on the final tree
# (every kernel changed in session 6 was tested per change; the review fixes of its end were not:
# the side stream's try/finally join, per-thread side streams, the prefill grid-limit check, and
# the stronger stream test that delays both streams).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not fp16 and not fp32" > $R/t_gpu.log 2>&1 & P1=$!
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_mla.py tests/test_gpu_engine.py > $R/t_other.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_other; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
cd $OUT && tar czf r.tgz r && rm -rf r
