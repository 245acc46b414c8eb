#!/bin/bash
# Session 6, run D (the last of the session's device time). carry [".exp_prev"] (run C's snapshot:
# longest-first order, no short tiles, no second stream). It runs:
# 1. the bf16 GPU tests run C's timeout cut off (short-prefill tiles at heads 96/128 on every
#    feature; the second stream under a caller's stream and a graph capture; autotune), with the
#    features over MIXED again (eager prefill + rest on two streams), test names logged;
# 2. prefill alone, this tree and .exp_prev alternating (S=32768 moved 8% between the two in run C
#    with the same kernel and tiles);
# 3. the engine end to end (its mixed steps now run the decodes on the second stream).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 300 python -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu.py -k "short and not fp16 and not fp32" > $R/t_short.log 2>&1 & P1=$!
timeout 300 python -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu.py \
  -k "(streams or autotune or features) and not fp16 and not fp32" > $R/t_rest.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_short t_rest; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
B="python -m pagedattn.bench --no-ceilings --workload prefill --provider pagedattn"
for i in 1 2; do
  timeout 40 $B --json $R/pre_cur$i.json --markdown $R/pre_cur$i.md > $R/pre_cur$i.log 2>&1; echo "cur $i rc=$?"
  (cd .exp_prev && PYTHONPATH=. timeout 40 $B --json $R/pre_prev$i.json --markdown $R/pre_prev$i.md > $R/pre_prev$i.log 2>&1; echo "prev $i rc=$?")
done
timeout 120 python -m pagedattn bench e2e --json $R/e2e.json --markdown $R/e2e.md > $R/e2e.log 2>&1; echo "e2e rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for f in pre_cur1 pre_prev1 pre_cur2 pre_prev2 e2e; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-170; done
