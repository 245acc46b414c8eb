#!/bin/bash
# Session 4, run F (final): the split rule capped at 32 splits per sequence and one wave; the
# bench reports the graph replay for host-bound calls. Decode grid and prefill/extend/mixed with
# the anchors, then GPU tests of the split-KV path under the new rule.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 100 python -m pagedattn.bench --workload decode --provider pagedattn,sdpa-cudnn --json $R/decode.json --markdown $R/decode.md > $R/decode.log 2>&1; echo "decode rc=$?"
timeout 150 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "split or invariant or graph" > $R/t_gpu.log 2>&1; echo "tests rc=$?"; tail -1 $R/t_gpu.log
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/decode.md | grep '^|' | cut -c1-170; tar xzf r.tgz -O r/pem.md | grep '^|' | cut -c1-200
