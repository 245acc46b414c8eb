#!/bin/bash
# Run G (session 3): counter reset in the reduce kernel: persistent/graph GPU tests, then waves.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "persistent or graph" > $R/t_gpu.log 2>&1; echo "tests rc=$?"; tail -2 $R/t_gpu.log
timeout 110 python -m pagedattn.bench.waves --json $R/waves.json --plot $R > $R/waves.log 2>&1; echo "waves rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/waves.log | tail -6
