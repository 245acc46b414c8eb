#!/bin/bash
# Session 7, run C. Run B: raw-score softmax (this tree) ran 2% slower than .exp_i32 on 128x128
# tiles and 2% faster on 64x64 (S=2048), and the graph sweep had 64x64 ahead at S=8192 too.
# Snapshots (carry [".exp_s64", ".exp_i32s64"]): .exp_s64 = this tree with 64x64 w4 s3 tiles for
# every head-128 prefill; .exp_i32s64 = b6ad94f (scores formed) with the same. It runs
# prefill/extend/mixed on this tree, .exp_s64 and .exp_i32s64, alternating twice.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
P="python -m pagedattn.bench --no-ceilings --workload prefill,extend,mixed --provider pagedattn"
for i in 1 2; do
  timeout 50 $P --json $R/pem_cur_$i.json --markdown $R/pem_cur_$i.md > $R/pem_cur_$i.log 2>&1; echo "cur $i rc=$?"
  for d in s64 i32s64; do
    (cd .exp_$d && PYTHONPATH=. timeout 50 $P --json $R/pem_${d}_$i.json --markdown $R/pem_${d}_$i.md > $R/pem_${d}_$i.log 2>&1; echo "$d $i rc=$?")
  done
done
cd $OUT && tar czf r.tgz r && rm -rf r
for f in pem_cur_1 pem_s64_1 pem_i32s64_1 pem_cur_2 pem_s64_2 pem_i32s64_2; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^| [pem]' | cut -c1-150; done
