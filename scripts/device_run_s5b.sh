#!/bin/bash
# The second GPU run planned for the next session (after scripts/next_gpu_run.sh):
# 1. the prefill kernel over contiguous K/V with the opt-in TMA loads off and on (perf-notes
#    experiment 18: 255 regs + 32 B spill -> 244 regs at 128x128 w8 s3), with cuDNN / FA2;
# 2. paged prefill at 128x64 tiles (static: 222 regs and no spill at w8 s3, 220 at s4, against
#    255 + 32 B spill at the default 128x128 w8 s3).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
for tma in 0 1; do
  A=sdpa-cudnn,sdpa-flash; [ $tma = 1 ] && A=""
  PAGEDATTN_TMA=$tma timeout 150 python scripts/gpu_prefill_sweep.py --variants contig --lengths 2048,8192,32768 \
    --configs 128x128x8x3,128x128x8x2,128x64x8x3,128x64x4x3 --anchors "$A" --json $R/sweep_tma$tma.json > $R/sweep_tma$tma.log 2>&1
  echo "sweep tma=$tma rc=$?"
done
timeout 150 python scripts/gpu_prefill_sweep.py --variants paged --lengths 2048,8192,32768 \
  --configs 128x128x8x3,128x64x8x3,128x64x8x4,64x64x4x3 --anchors "" --json $R/sweep_paged.json > $R/sweep_paged.log 2>&1
echo "paged sweep rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for f in sweep_tma0 sweep_tma1 sweep_paged; do echo "-- $f"; tar xzf r.tgz -O r/$f.log | grep '^|'; done
