#!/bin/bash
# Session 5, run F (final for #6): the paged prefill kernel of experiment 20 (per-chunk id
# checks, one gather per page) and TMA loads on by default for contiguous K/V on sm90.
# 1. GPU tests of the prefill and varlen paths (bf16), TMA and pointer loads;
# 2. prefill/extend/mixed with cuDNN and FA2 in the same run;
# 3. heads 64, 128, 256: contiguous and paged, default tiles, with the anchors (graph replays).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 260 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "(prefill or varlen) and not fp16 and not fp32" > $R/t_gpu.log 2>&1; echo "tests rc=$?"; tail -1 $R/t_gpu.log
timeout 150 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
timeout 150 python scripts/gpu_prefill_sweep.py --graph --heads 64,128,256 --lengths 2048,8192,32768 --configs default \
  --json $R/heads.json > $R/heads.log 2>&1; echo "heads rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
tar xzf r.tgz -O r/t_gpu.log | grep -E "FAILED|Error" | head -8
tar xzf r.tgz -O r/pem.md | grep '^|' | cut -c1-200; tar xzf r.tgz -O r/heads.log | grep '^| [0-9]'
