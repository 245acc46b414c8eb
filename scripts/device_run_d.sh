#!/bin/bash
# Run D (session 3): GPU correctness of this session's kernels and helpers' code (four pytest
# processes in parallel: compiling is CPU-bound), then the end-to-end engine benchmark alone.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
python -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "varlen or paged_prefill or graph or persistent" > $R/t_gpu.log 2>&1 & P1=$!
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py > $R/t_engine.log 2>&1 & P2=$!
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_mla.py -k "sweep_configs or configs_spec" > $R/t_mla.log 2>&1 & P3=$!
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/test_backends.py > $R/t_backends.log 2>&1 & P4=$!
for p in $P1 $P2 $P3 $P4; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_engine t_mla t_backends; do echo "== $f"; tail -4 $R/$f.log; done
timeout 270 python -m pagedattn bench e2e --json $R/e2e.json --markdown $R/e2e.md > $R/e2e.log 2>&1; echo "e2e rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/e2e.md 2>/dev/null | head -40; tar xzf r.tgz -O r/e2e.log | tail -8
