#!/bin/bash
# Run F (session 3): persistent 'auto' schedule and the MLA small-batch default: GPU tests in
# parallel, then waves (with the auto column) and the default-config MLA benchmark.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "persistent or graph" > $R/t_gpu.log 2>&1 & P1=$!
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_mla.py -k "mla_decode_gpu or splits or graph" > $R/t_mla.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_mla; do echo "== $f"; tail -3 $R/$f.log; done
timeout 110 python -m pagedattn.bench.waves --json $R/waves.json --plot $R > $R/waves.log 2>&1; echo "waves rc=$?"
timeout 100 python -m pagedattn.bench.mla --json $R/mla.json > $R/mla.log 2>&1; echo "mla rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/waves.log | tail -6; tar xzf r.tgz -O r/mla.log | tail -12
