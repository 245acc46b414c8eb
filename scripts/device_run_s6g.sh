#!/bin/bash
# Session 6, run G (the last ~230 s of device time): the MLA decode kernel with experiment 20's
# changes (block ids a chunk at a time, checked once; two tile loops; hoisted slots; one gather per
# page), built by a helper in .exp_mla1 (carry [".exp_mla1"]). MLA bench of this tree, then of
# the variant (same run), then the variant's bf16 MLA GPU tests (from inside .exp_mla1).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
M="python -m pagedattn.bench.mla --batch 1 32 128 --seq-len 4096 32768"
timeout 50 $M --json $R/mla_cur.json > $R/mla_cur.log 2>&1; echo "mla cur rc=$?"
(cd .exp_mla1 && PYTHONPATH=. timeout 50 $M --no-baseline --json $R/mla_var.json > $R/mla_var.log 2>&1; echo "mla var rc=$?")
(cd .exp_mla1 && PYTHONPATH=. timeout 125 python -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu_mla.py > $R/t_mla.log 2>&1; echo "t_mla rc=$?")
grep -E "FAILED|Error" $R/t_mla.log | head -5; grep -c PASSED $R/t_mla.log; tail -1 $R/t_mla.log
cd $OUT && tar czf r.tgz r && rm -rf r
for f in mla_cur mla_var; do echo "-- $f"; tar xzf r.tgz -O r/$f.log | grep -E '^\||x ' | cut -c1-160 | tail -12; done
