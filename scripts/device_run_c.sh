#!/bin/bash
# Run C (session 3): block-table chunks in every paged kernel: bf16 GPU tests, decode A/B against
# the previous commit (.exp_prev), prefill sweep of the new kernel, prefill/extend/mixed with anchors.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu.py -k "not fp16 and not fp32" > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gpu_tests.log
for v in cur prev; do
  P=.; PV=pagedattn,sdpa-cudnn; [ $v = prev ] && { P=.exp_prev; PV=pagedattn; }
  PYTHONPATH=$P timeout 100 python -m pagedattn.bench --workload decode --case "B=1 L=32768" --case "B=8 L=4096" --case "B=32 L=32768" --case "B=128 L=32768" --case "B=1 L=4096" --case "B=128 L=4096" --provider $PV --no-ceilings --json $R/dec_$v.json --markdown $R/dec_$v.md > $R/dec_$v.log 2>&1; echo "dec $v rc=$?"
done
timeout 120 python scripts/gpu_prefill_sweep.py --lengths 8192 --anchors sdpa-cudnn \
  --configs 128x128x8x3,128x128x8x2,128x64x8x3,128x64x4x3 --json $R/sweep.json > $R/sweep.log 2>&1; echo "sweep rc=$?"
timeout 150 python -m pagedattn.bench --workload prefill,extend,mixed --provider pagedattn,sdpa-cudnn,sdpa-flash --no-ceilings --json $R/pem.json --markdown $R/pem.md > $R/pem.log 2>&1; echo "pem rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for v in cur prev; do echo "-- $v"; tar xzf r.tgz -O r/dec_$v.md 2>/dev/null | grep '^|' | cut -c1-160; done
tar xzf r.tgz -O r/sweep.log | grep '^|' | head -14; tar xzf r.tgz -O r/pem.md | grep '^|' | cut -c1-200
