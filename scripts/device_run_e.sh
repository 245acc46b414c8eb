#!/bin/bash
# Run E (session 3): MLA decode config sweep, router vs single launch, waves (+ plot).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 260 python -m pagedattn.bench.mla --sweep --time-budget 190 --json $R/mla-sweep.json > $R/mla-sweep.log 2>&1; echo "mla rc=$?"
timeout 150 python -m pagedattn.bench --workload prefill-heavy,decode-heavy,mixed --provider pagedattn,router,router-gather --no-ceilings --json $R/router.json --markdown $R/router.md > $R/router.log 2>&1; echo "router rc=$?"
timeout 100 python -m pagedattn.bench.waves --json $R/waves.json --plot $R > $R/waves.log 2>&1; echo "waves rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/mla-sweep.log | tail -30; tar xzf r.tgz -O r/router.md | grep '^|'; tar xzf r.tgz -O r/waves.log | tail -12
