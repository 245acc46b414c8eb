#!/bin/bash
# Session 6, run F: batch-1 TTFT of the engine (500-token prompt) went 16 -> 30-37 ms from run B to
# runs D-E. This tree, .exp_prev (run C's snapshot: no short tiles, no second stream) and
# .exp_noshort (this tree with SHORT_PREFILL_WAVES = 0), alternating; carry all three.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
E="python -m pagedattn bench e2e --attention pagedattn --no-batch"
for t in 1 2; do
  timeout 60 $E --json $R/cur$t.json --markdown $R/cur$t.md > $R/cur$t.log 2>&1; echo "cur $t rc=$?"
  for d in prev noshort; do
    (cd .exp_$d && PYTHONPATH=. timeout 60 $E --json $R/$d$t.json --markdown $R/$d$t.md > $R/$d$t.log 2>&1; echo "$d $t rc=$?")
  done
done
cd $OUT && tar czf r.tgz r && rm -rf r
for f in cur1 prev1 noshort1 cur2 prev2 noshort2; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^| pagedattn' | cut -c1-100; done
