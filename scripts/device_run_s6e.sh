#!/bin/bash
# Session 6, run E: run D's engine batch row (64 x 2048 prompts: TTFT 6226 ms against 3231 in run B,
# the other attention modes unchanged at ~3240) again, twice, then with PAGEDATTN_OVERLAP=0.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
for t in a b; do
  timeout 100 python -m pagedattn bench e2e --attention pagedattn --json $R/e2e_$t.json --markdown $R/e2e_$t.md > $R/e2e_$t.log 2>&1; echo "e2e $t rc=$?"
done
PAGEDATTN_OVERLAP=0 timeout 100 python -m pagedattn bench e2e --attention pagedattn --json $R/e2e_serial.json --markdown $R/e2e_serial.md > $R/e2e_serial.log 2>&1; echo "e2e serial rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for f in e2e_a e2e_b e2e_serial; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^| pagedattn' | cut -c1-120; done
