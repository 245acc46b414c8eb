#!/bin/bash
# Run B (session 3): paged vs contiguous prefill diagnostics (TTGIR), head 64/256 tiles, decode harness check.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R/ttgir
timeout 150 python scripts/gpu_prefill_sweep.py --lengths 8192 --anchors sdpa-cudnn --dump $R/ttgir \
  --configs 128x64x8x3,128x128x8x3,128x64x4x3,128x64x4x4,128x128x8x2,128x64x8x2,64x64x4x4,128x128x4x2 \
  --json $R/sweep_paged.json > $R/sweep_paged.log 2>&1; echo "sweep paged rc=$?"
timeout 120 python scripts/gpu_prefill_sweep.py --heads 64,256 --lengths 8192 --anchors sdpa-cudnn --json $R/sweep_heads.json > $R/sweep_heads.log 2>&1; echo "heads rc=$?"
timeout 120 python -m pagedattn.bench.tune_decode --case "B=1 L=32768" --case "B=8 L=4096" --tile-n 64 --warps 4 --stages 2,3 --splits auto,8,16,32 --json $R/tune.json > $R/tune.log 2>&1; echo "tune rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/sweep_paged.log | grep '^|'; tar xzf r.tgz -O r/sweep_heads.log | grep '^|'; tar xzf r.tgz -O r/tune.log | tail -25
