#!/bin/bash
# The first GPU run planned for the next session (docs/session-2026-11-29-s4.md). Before it:
#   scripts/make_snapshot.sh HEAD .exp_prev       # the GPU-verified kernels of session 4
#   git apply docs/exp/find_q_block.patch         # the experiment (perf-notes experiment 19)
# and call the device with carry [".exp_prev"]. It runs:
# 1. the GPU tests of the kernels not yet run on a device (find_q_block in every Q-block kernel
#    and MLA; the opt-in TMA prefill path), in two parallel processes;
# 2. the decode grid against .exp_prev (metadata loaded with the sequence lookup: one memory
#    round trip fewer per program; perf-notes experiment 19) and cuDNN;
# (then scripts/next_gpu_run_b.sh: prefill with TMA on and off, paged prefill tiles.)
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py -k "not fp16 and not fp32" > $R/t_gpu.log 2>&1 & P1=$!
timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_mla.py tests/test_gpu_engine.py > $R/t_other.log 2>&1 & P2=$!
for p in $P1 $P2; do wait $p; echo "pid $p rc=$?"; done
for f in t_gpu t_other; do echo "== $f"; grep -E "FAILED|Error" $R/$f.log | head -5; tail -1 $R/$f.log; done
timeout 100 python -m pagedattn.bench --workload decode --provider pagedattn,sdpa-cudnn --json $R/dec_cur.json --markdown $R/dec_cur.md > $R/dec_cur.log 2>&1; echo "dec cur rc=$?"
[ -d .exp_prev ] && (cd .exp_prev && PYTHONPATH=. timeout 100 python -m pagedattn.bench --workload decode --provider pagedattn \
  --no-ceilings --json $R/dec_prev.json --markdown $R/dec_prev.md > $R/dec_prev.log 2>&1; echo "dec prev rc=$?")
cd $OUT && tar czf r.tgz r && rm -rf r
for v in cur prev; do echo "-- $v"; tar xzf r.tgz -O r/dec_$v.md 2>/dev/null | grep '^|' | cut -c1-150; done
