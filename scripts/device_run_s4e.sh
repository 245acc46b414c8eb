#!/bin/bash
# Session 4, run E (final): the new split rule (plan.choose_num_splits) on the decode grid with
# cuDNN; prefill/extend/mixed with the anchors; the persistent path's waves at 3-stage tiles; MLA.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 100 python -m pagedattn.bench --workload decode --provider pagedattn,sdpa-cudnn --json $R/decode.json --markdown $R/decode.md > $R/decode.log 2>&1; echo "decode rc=$?"
timeout 150 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
timeout 110 python -m pagedattn.bench.waves --json $R/waves.json --plot $R > $R/waves.log 2>&1; echo "waves rc=$?"
timeout 60 python -m pagedattn.bench.mla --batch 1 32 --seq-len 4096 32768 --json $R/mla.json > $R/mla.log 2>&1; echo "mla rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/decode.md | grep '^|' | cut -c1-170; tar xzf r.tgz -O r/pem.md | grep '^|' | cut -c1-200
tar xzf r.tgz -O r/waves.log | tail -6; tar xzf r.tgz -O r/mla.log | grep '^|' | cut -c1-160
