#!/bin/bash
# Session 4, run B: the merge of split partials read as [SPLIT_BLOCK, head] tiles (was one load per
# split) and 3-stage decode tiles. GPU tests, the decode grid against the session's start
# (.exp_prev) and cuDNN, the split-count sweep with both tile widths, MLA (shares the merge).
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "fp16 or fp32 or split or invariant" > $R/t_gpu_a.log 2>&1 & P1=$!
timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not (fp16 or fp32 or split or invariant)" > $R/t_gpu_b.log 2>&1 & P2=$!
timeout 250 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_mla.py > $R/t_mla.log 2>&1 & P3=$!
for p in $P1 $P2 $P3; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu_a t_gpu_b t_mla; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
for v in cur prev; do
  P=.; PV=pagedattn,sdpa-cudnn; [ $v = prev ] && { P=.exp_prev; PV=pagedattn; }
  PYTHONPATH=$P timeout 120 python -m pagedattn.bench --workload decode --provider $PV --no-ceilings --json $R/dec_$v.json --markdown $R/dec_$v.md > $R/dec_$v.log 2>&1; echo "dec $v rc=$?"
done
timeout 150 python -m pagedattn.bench.tune_decode --case "B=1 L=32768" --case "B=1 L=4096" --case "B=8 L=4096" --case "B=8 L=32768" \
  --case "B=32 L=512" --tile-n 32,64 --warps 4 --stages 3 --splits auto,16,32,64,128 --json $R/splits.json > $R/splits.log 2>&1; echo "splits rc=$?"
timeout 60 python -m pagedattn.bench.mla --batch 1 32 --seq-len 32768 --json $R/mla.json > $R/mla.log 2>&1; echo "mla rc=$?"
cd $OUT && tar czf r.tgz r && rm -rf r
for v in cur prev; do echo "-- $v"; tar xzf r.tgz -O r/dec_$v.md 2>/dev/null | grep '^|' | cut -c1-150; done
tar xzf r.tgz -O r/splits.log | cut -c1-112; tar xzf r.tgz -O r/mla.log | grep '^|' | cut -c1-200
