#!/bin/bash
# The first GPU run planned for the next session (docs/session-2026-11-29-s6.md), up to ~7 minutes.
# Before it, on the CPU machine:
#   scripts/make_snapshot.sh 3d6e42a .exp_s3     # the MLA kernel of session 3's run F (181 us at 32x4096)
#   rm -rf .exp_mlachunk && mkdir .exp_mlachunk && cp -r pagedattn .exp_mlachunk/ && \
#     sed -i 's/^CHUNK_TARGET_KEYS = 2048/CHUNK_TARGET_KEYS = 8192/' .exp_mlachunk/pagedattn/ops/mla/kernel.py && \
#     echo /.exp_mlachunk/ >> .git/info/exclude
#   scripts/make_snapshot.sh HEAD .exp_p32 && cp -r tests pyproject.toml .exp_p32/ && \
#     (cd .exp_p32 && patch -p1 < ../docs/exp/prefill_int32.patch)   # experiment 29
# then call the device with carry [".exp_s3", ".exp_mlachunk", ".exp_p32"]. It runs:
# 1. the MLA bench: this tree, session 3's kernel and this tree with 8192-key block-table chunks
#    (experiment 28: the "before" column ran 10-13% slower than session 3's run F; 128x32768 lost
#    2% with 2048-key chunks, 16 pipeline restarts per program);
# 2. the decode grid on the 2D, split-KV and persistent paths with cuDNN (the persistent kernel won
#    at B=32/128 L=4096 and for 63 decodes at 2049 keys: a rule for 1-3 waves of long programs);
# 2b. prefill/extend/mixed, this tree against .exp_p32 (int32 K/V offsets in the prefill kernel,
#    experiment 29: predicted 2-5% at S >= 8192 and on the extend), and .exp_p32's bf16 prefill tests;
# (~7 minutes at most; then scripts/next_gpu_run_b.sh: the full bf16 GPU suite, ~5 minutes.)
export PYTHONPATH=.
R=$OUT/r; mkdir -p $R
M="python -m pagedattn.bench.mla --batch 1 32 128 --seq-len 4096 32768"
timeout 50 $M --json $R/mla_cur.json > $R/mla_cur.log 2>&1; echo "mla cur rc=$?"
for d in s3 mlachunk; do
  [ -d .exp_$d ] && (cd .exp_$d && PYTHONPATH=. timeout 50 $M --no-baseline --json $R/mla_$d.json > $R/mla_$d.log 2>&1; echo "mla $d rc=$?")
done
timeout 120 python -m pagedattn.bench --workload decode --provider pagedattn-2d,pagedattn-split,pagedattn-persistent,sdpa-cudnn \
  --no-ceilings --json $R/dec.json --markdown $R/dec.md > $R/dec.log 2>&1; echo "dec rc=$?"
P="python -m pagedattn.bench --no-ceilings --workload prefill,extend,mixed --provider pagedattn"
timeout 60 $P --json $R/pem_cur.json --markdown $R/pem_cur.md > $R/pem_cur.log 2>&1; echo "pem cur rc=$?"
[ -d .exp_p32 ] && (cd .exp_p32 && PYTHONPATH=. timeout 60 $P --json $R/pem_p32.json --markdown $R/pem_p32.md > $R/pem_p32.log 2>&1; echo "pem p32 rc=$?"
  PYTHONPATH=. timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
    -k "(varlen or paged_prefill or short or cache_past) and not fp16 and not fp32" > $R/t_p32.log 2>&1; echo "t_p32 rc=$?"; tail -1 $R/t_p32.log)
cd $OUT && tar czf r.tgz r && rm -rf r
for f in mla_cur mla_s3 mla_mlachunk; do echo "-- $f"; tar xzf r.tgz -O r/$f.log 2>/dev/null | grep -E '^\| [0-9]' | cut -c1-120; done
tar xzf r.tgz -O r/dec.md | grep '^|' | cut -c1-200
for f in pem_cur pem_p32; do echo "-- $f"; tar xzf r.tgz -O r/$f.md 2>/dev/null | grep '^|' | cut -c1-120; done
