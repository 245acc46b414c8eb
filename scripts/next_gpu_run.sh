#!/bin/bash
# The first GPU run planned for the next session (docs/session-2026-11-29-s4.md): the opt-in
# tensor-descriptor (TMA) K/V loads of the prefill kernel over contiguous K/V (perf-notes
# experiment 18: static 255 regs + 32 B spill -> 244 regs, no spill at 128x128 w8 s3), checked in
# bf16 and timed against the pointer loads in the same run, with cuDNN / FA2.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "varlen" > $R/t_varlen.log 2>&1; echo "tests rc=$?"
grep -E "FAILED|Error" $R/t_varlen.log | head -5; tail -1 $R/t_varlen.log
for tma in 0 1; do
  A=sdpa-cudnn,sdpa-flash; [ $tma = 1 ] && A=""
  PAGEDATTN_TMA=$tma timeout 200 python scripts/gpu_prefill_sweep.py --variants contig --lengths 2048,8192,32768 \
    --configs 128x128x8x3,128x128x8x2,128x64x8x3,128x64x4x3 --anchors "$A" --json $R/sweep_tma$tma.json > $R/sweep_tma$tma.log 2>&1
  echo "sweep tma=$tma rc=$?"
  PAGEDATTN_TMA=$tma timeout 100 python scripts/gpu_prefill_sweep.py --variants contig --heads 64,256 --lengths 8192 \
    --anchors "$A" --json $R/heads_tma$tma.json > $R/heads_tma$tma.log 2>&1; echo "heads tma=$tma rc=$?"
done
cd $OUT && tar czf r.tgz r && rm -rf r
for tma in 0 1; do echo "-- TMA=$tma"; tar xzf r.tgz -O r/sweep_tma$tma.log | grep '^|'; tar xzf r.tgz -O r/heads_tma$tma.log | grep '^|'; done
