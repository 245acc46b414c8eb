#!/bin/bash
# Session 4, run C: find_seq_idx counts sequence starts with one vector load (was a binary
# search); GPU tests of the Q-block kernels; decode grid against the session's start (.exp_prev,
# run from inside it: `python -m` puts the working directory first on sys.path, so
# PYTHONPATH=.exp_prev alone measured the current tree in every earlier A/B) and cuDNN; the merge's
# share of a split-KV call; the split-count sweep at the default tiles.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 230 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not (fp16 or fp32)" > $R/t_gpu.log 2>&1; echo "tests rc=$?"
grep -E "FAILED|Error" $R/t_gpu.log | head -5; tail -1 $R/t_gpu.log
timeout 100 python -m pagedattn.bench --workload decode --provider pagedattn,sdpa-cudnn --no-ceilings --json $R/dec_cur.json --markdown $R/dec_cur.md > $R/dec_cur.log 2>&1; echo "dec cur rc=$?"
(cd .exp_prev && PYTHONPATH=. timeout 100 python -m pagedattn.bench --workload decode --provider pagedattn --no-ceilings --json $R/dec_prev.json --markdown $R/dec_prev.md > $R/dec_prev.log 2>&1; echo "dec prev rc=$?")
timeout 60 python scripts/decode_reduce_cost.py > $R/reduce_cost.log 2>&1; echo "reduce cost rc=$?"
timeout 200 python -m pagedattn.bench.tune_decode --case "B=1 L" --case "B=8 L" --case "B=32 L=512" --case "B=32 L=4096" \
  --tile-n 64 --warps 4 --stages 3 --splits auto,1,2,4,8,16,24,32,48 --json $R/splits.json > $R/splits.log 2>&1; echo "splits rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for v in cur prev; do echo "-- $v"; tar xzf r.tgz -O r/dec_$v.md 2>/dev/null | grep '^|' | cut -c1-150; done
tar xzf r.tgz -O r/reduce_cost.log; tar xzf r.tgz -O r/splits.log | cut -c1-100
