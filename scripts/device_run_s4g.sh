#!/bin/bash
# Session 4, run G: the persistent grid at one wave of resident programs (3 per SM) and its work
# list cut by the split-KV rule (<= 1 item per program). Persistent/graph GPU tests, then waves.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "persistent or graph" > $R/t_gpu.log 2>&1; echo "tests rc=$?"; tail -1 $R/t_gpu.log
timeout 100 python -m pagedattn.bench.waves --json $R/waves.json --plot $R > $R/waves.log 2>&1; echo "waves rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/waves.log | tail -6
