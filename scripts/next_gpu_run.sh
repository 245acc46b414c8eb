#!/bin/bash
# The first GPU run planned for the next session (see docs/session-2026-11-29-s3.md and
# docs/perf-notes.md experiment 16): GPU tests not re-run after session 3's last edits, in
# parallel processes (compiling is CPU-bound), then the decode tile sweep that tests the
# register/occupancy hypothesis, then the decode grid with anchors.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 400 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "fp16 or fp32" > $R/t_gpu_fp.log 2>&1 & P1=$!
timeout 400 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not fp16 and not fp32" > $R/t_gpu_bf16.log 2>&1 & P2=$!
timeout 400 python -m pytest -m gpu -q -p no:cacheprovider tests/test_backends.py tests/test_gpu_engine.py > $R/t_other.log 2>&1 & P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu_fp t_gpu_bf16 t_other; do echo "== $f"; tail -2 $R/$f.log; done
timeout 240 python -m pagedattn.bench.tune_decode --case "B=1 L=32768" --case "B=8 L=4096" --case "B=32 L=32768" \
  --tile-n 32,64,128 --warps 2,4 --stages 2,3 --json $R/tune.json > $R/tune.log 2>&1; echo "tune rc=$?"
timeout 200 python -m pagedattn.bench --workload decode --provider pagedattn,sdpa-cudnn --json $R/decode.json \
  --markdown $R/decode.md > $R/decode.log 2>&1; echo "decode rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/tune.log | grep BEST; tar xzf r.tgz -O r/decode.md | grep '^|'
