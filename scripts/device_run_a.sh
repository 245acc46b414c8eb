#!/bin/bash
# Run A (session 3): verify prefill/decode kernel edits in bf16, prefill tile sweep, decode bounds A/B.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 170 python -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu.py -k "varlen or paged_prefill or split_kv or (features_gpu and bf16)" > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gpu_tests.log
timeout 200 python scripts/gpu_prefill_sweep.py --json $R/sweep128.json > $R/sweep128.log 2>&1; echo "sweep rc=$?"
timeout 60 python scripts/gpu_prefill_sweep.py --heads 64,256 --lengths 8192 --json $R/sweep_heads.json > $R/sweep_heads.log 2>&1; echo "heads rc=$?"
for v in cur nob base; do
  case $v in cur) P=.;; nob) P=.exp_nobounds;; base) P=.baseline;; esac
  PV=pagedattn; [ $v = cur ] && PV=pagedattn,sdpa-cudnn
  PYTHONPATH=$P timeout 90 python -m pagedattn.bench --workload decode --case "B=1 L=32768" --case "B=8 L=4096" --case "B=32 L=32768" --case "B=128 L=32768" --provider $PV --no-ceilings --json $R/dec_$v.json --markdown $R/dec_$v.md > $R/dec_$v.log 2>&1; echo "dec $v rc=$?"
done
timeout 60 python -m pagedattn.bench --workload extend,mixed --provider pagedattn,sdpa-cudnn --no-ceilings --json $R/extmix.json --markdown $R/extmix.md > $R/extmix.log 2>&1; echo "extmix rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
echo ==== ; tar xzf r.tgz -O r/sweep128.log | grep '^|' ; tar xzf r.tgz -O r/sweep_heads.log | grep '^|'
for v in cur nob base; do echo "-- $v"; tar xzf r.tgz -O r/dec_$v.md 2>/dev/null | grep '^|' | cut -c1-150; done
tar xzf r.tgz -O r/extmix.md | grep '^|' | cut -c1-150
