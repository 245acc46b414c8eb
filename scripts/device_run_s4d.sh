#!/bin/bash
# Session 4, run D: programmatic dependent launch of the merge kernels (split-KV, persistent, MLA).
# GPU tests (graph capture included), the merge's share with PDL on and off, and the split-count
# sweep on the cases the new planner rule would change.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 260 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not fp16 and not fp32" > $R/t_gpu.log 2>&1 & P1=$!
timeout 260 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_mla.py tests/test_gpu_engine.py tests/test_backends.py > $R/t_other.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_other; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
timeout 60 python scripts/decode_reduce_cost.py > $R/reduce_pdl.log 2>&1; echo "reduce pdl rc=$?"
PAGEDATTN_PDL=0 timeout 60 python scripts/decode_reduce_cost.py > $R/reduce_nopdl.log 2>&1; echo "reduce nopdl rc=$?"
timeout 200 python -m pagedattn.bench.tune_decode --case "B=32 L=32768" --case "B=128 L=4096" --case "B=128 L=32768" \
  --tile-n 64 --warps 4 --stages 3 --splits 1,2,3,4,8,16 --json $R/splits_big.json > $R/splits_big.log 2>&1; echo "splits big rc=$?"
timeout 80 python -m pagedattn.bench.tune_decode --case "B=1 L=32768" --case "B=8 L=4096" --case "B=1 L=4096" \
  --tile-n 64 --warps 4 --stages 3 --splits 4,5,6,16,32,33,40 --json $R/splits_small.json > $R/splits_small.log 2>&1; echo "splits small rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
echo "-- PDL on"; tar xzf r.tgz -O r/reduce_pdl.log; echo "-- PDL off"; tar xzf r.tgz -O r/reduce_nopdl.log
tar xzf r.tgz -O r/splits_big.log | cut -c1-100; tar xzf r.tgz -O r/splits_small.log | cut -c1-100
