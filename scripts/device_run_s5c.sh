#!/bin/bash
# Session 5, run C (experiment 20): what makes paged prefill slower than contiguous.
# Needs `python scripts/make_prefill_variants.py` and carry [".exp_v0", ..., ".exp_v4"].
# 1. paged prefill in five kernel variants (graph replay), 128x128 and 128x64 tiles;
# 2. contiguous prefill, TMA off / on, as graph replays (run B timed TMA eagerly: host-bound at S=2048).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
S=$PWD/scripts/gpu_prefill_sweep.py
for v in v0 v1 v2 v3 v4; do
  (cd .exp_$v && PYTHONPATH=. timeout 100 python $S --graph --variants paged --lengths 2048,8192 \
    --configs 128x128x8x3,128x64x8x3 --anchors "" --json $R/paged_$v.json > $R/paged_$v.log 2>&1; echo "paged $v rc=$?")
done
for tma in 0 1; do
  A=sdpa-cudnn; [ $tma = 1 ] && A=""
  PAGEDATTN_TMA=$tma timeout 120 python $S --graph --variants contig --lengths 2048,8192,32768 \
    --configs 128x128x8x3,128x128x8x2 --anchors "$A" --json $R/contig_tma$tma.json > $R/contig_tma$tma.log 2>&1
  echo "contig tma=$tma rc=$?"
done
cd $OUT && tar czf r.tgz r && rm -rf r
for f in paged_v0 paged_v1 paged_v2 paged_v3 paged_v4 contig_tma0 contig_tma1; do echo "-- $f"; tar xzf r.tgz -O r/$f.log | grep '^| 128'; done
