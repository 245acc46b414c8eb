#!/bin/bash
# Session 4, run A: the GPU tests not re-run after session 3's last edits (in parallel processes:
# compiling is CPU-bound), then the decode A/B of int32 K/V offsets (perf-notes experiment 17)
# against the previous commit (.exp_prev) with cuDNN in the same run, then decode tiles and splits.
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "fp16 or fp32" > $R/t_gpu_fp.log 2>&1 & P1=$!
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not fp16 and not fp32" > $R/t_gpu_bf16.log 2>&1 & P2=$!
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_backends.py tests/test_gpu_engine.py tests/test_gpu_mla.py > $R/t_other.log 2>&1 & P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu_fp t_gpu_bf16 t_other; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
for v in cur prev; do
  P=.; PV=pagedattn,sdpa-cudnn; [ $v = prev ] && { P=.exp_prev; PV=pagedattn; }
  PYTHONPATH=$P timeout 120 python -m pagedattn.bench --workload decode --provider $PV --no-ceilings --json $R/dec_$v.json --markdown $R/dec_$v.md > $R/dec_$v.log 2>&1; echo "dec $v rc=$?"
done
timeout 100 python -m pagedattn.bench.tune_decode --case "B=1 L=32768" --case "B=8 L=4096" --case "B=32 L=32768" \
  --tile-n 32,64 --warps 4 --stages 2,3 --json $R/tune.json > $R/tune.log 2>&1; echo "tune rc=$?"
timeout 60 python -m pagedattn.bench.tune_decode --case "B=1 L=32768" --case "B=1 L=4096" --tile-n 64 --warps 4 --stages 3 \
  --splits auto,32,64,128,256 --json $R/splits.json > $R/splits.log 2>&1; echo "splits rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for v in cur prev; do echo "-- $v"; tar xzf r.tgz -O r/dec_$v.md 2>/dev/null | grep '^|' | cut -c1-150; done
tar xzf r.tgz -O r/tune.log | grep -v "^BEST" | cut -c1-120; tar xzf r.tgz -O r/splits.log | cut -c1-120
