#!/bin/bash
# The GPU run: tests and benchmarks of this checkout on a GPU machine, results to one folder.
#
#   scripts/gpu_run.sh [--tests] [--bench LIST] [--peers DIR] [--out DIR] [--ab DIR] [--repeat N]
#                      [--providers LIST] [--timeout S] [--quick]
#
#   --tests           the GPU test suite: python3 -m pytest -m gpu -q -n 8 (serial without pytest-xdist)
#   --bench LIST      comma list (default with no --tests: all):
#                       decode   the decode grid, B 1-128 x L 512-32768           -> decode.json
#                       prefill, extend, mixed (run as one call when given together)
#                                causal prefill S=512-32768, extend 4 x 512 on 4096,
#                                a 2048-token prefill among 63 decodes             -> prefill-extend-mixed.json
#                       mixes    the prefill-heavy and decode-heavy batch mixes     -> mixes.json
#                       hetero   a few long contexts among many short decodes         -> hetero.json
#                       specdecode  2-8 query tokens a sequence (speculative decode)     -> specdecode.json
#                       models   Gemma-3-12B's local and global, Llama-3.1-8B's and Mistral-7B's decode steps at vLLM's grid, also on the graph plan -> models.json
#                       heads    paged prefill at heads 64 and 256                 -> prefill-heads.json
#                       autotune prefill/extend/mixed with PAGEDATTN_AUTOTUNE=1     -> prefill-autotuned.json
#                       parts    the mixed batch's parts and streams               -> mixed-parts.json
#                       mla      MLA decode, 128 heads, B 1/32/128 x L 4096/32768  -> mla.json
#                       host     host time of one call                             -> host.json / host.md
#                       waves    CUDA graphs captured once, replayed smaller       -> waves.json, waves.png
#                       e2e      the engine end to end (Llama-3.1-8B shape)        -> e2e.json
#                     "all" = decode,prefill,extend,mixed,hetero,mla,host,e2e
#   --peers DIR       install the peers' wheels in DIR (FlashInfer, apache-tvm-ffi, cudnn-frontend) into
#                     /tmp/peers and put it on PYTHONPATH; the benchmark then times every available peer
#   --out DIR         results folder (default bench_out): NAME.json, NAME.md, logs/, plots; a short
#                     table of every result is printed last
#   --ab DIR          also run each benchmark from inside DIR (a snapshot made by
#                     scripts/make_snapshot.sh <commit> DIR), alternating with this tree --repeat times
#                     (default 2): results in OUT/cur/ and OUT/ab/
#   --providers LIST  kernel providers to time (default: pagedattn's own columns, the SDPA anchors and
#                     every available peer)
#   --timeout S       wall-clock limit of each step (default 300; FlashInfer compiles each kernel
#                     variant on its first use, 30-115 s, cached in ~/.cache/flashinfer)
#   --quick           tiny shapes; runs on a CPU through the Triton interpreter (GPU-only steps skipped)
#
# Examples (on the GPU machine, from the repository root):
#   scripts/gpu_run.sh --tests
#   scripts/gpu_run.sh --bench decode,prefill,extend,mixed --peers /tmp/wheels --out bench_out
#   scripts/make_snapshot.sh HEAD~1 .ab_prev && scripts/gpu_run.sh --bench prefill,extend,mixed --ab .ab_prev
#
# The commands it runs are the variables below; edit them there when the CLI changes.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

TESTS=0; BENCH=""; PEERS=""; OUT=bench_out; AB=""; REPEAT=""; PROVIDERS=""; TIMEOUT=300; QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS=1 ;;
    --bench) BENCH=$2; shift ;;
    --peers) PEERS=$2; shift ;;
    --out) OUT=$2; shift ;;
    --ab) AB=$2; shift ;;
    --repeat) REPEAT=$2; shift ;;
    --providers) PROVIDERS=$2; shift ;;
    --timeout) TIMEOUT=$2; shift ;;
    --quick) QUICK=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -z "$BENCH" ] && [ "$TESTS" = 0 ] && BENCH=all
[ "$BENCH" = all ] && BENCH=decode,prefill,extend,mixed,hetero,mla,host,e2e
[ -z "$REPEAT" ] && { [ -n "$AB" ] && REPEAT=2 || REPEAT=1; }
mkdir -p "$OUT/logs"; OUT=$(cd "$OUT" && pwd)
if [ -n "$AB" ]; then
  [ -d "$AB/pagedattn" ] || { echo "gpu_run.sh: --ab $AB has no pagedattn/ (make it with scripts/make_snapshot.sh)" >&2; exit 2; }
  AB=$(cd "$AB" && pwd)
fi

# ---- peers: wheels built elsewhere, installed without an index ------------------------------------
if [ -n "$PEERS" ]; then
  ls "$PEERS"/*.whl >/dev/null 2>&1 || { echo "gpu_run.sh: no wheels in $PEERS" >&2; exit 2; }
  $PY -m pip install -q --no-index --no-deps --target /tmp/peers "$PEERS"/*.whl > "$OUT/logs/peers.log" 2>&1 \
    || { echo "gpu_run.sh: installing the peers failed, see $OUT/logs/peers.log" >&2; exit 2; }
  export PYTHONPATH="$PYTHONPATH:/tmp/peers"
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  [ -x /opt/torch/.venv/bin/ninja ] && export PATH="$PATH:/opt/torch/.venv/bin"  # FlashInfer's JIT build
fi

# ---- the commands --------------------------------------------------------------------------------
CLI="$PY -m pagedattn.cli"
kernels_cmd() {  # the kernel benchmark's command in the tree $1 (a subcommand or the plain `bench`)
  if (cd "$1" && PYTHONPATH="$1${PYTHONPATH#$ROOT}" $CLI bench kernels --list --quick >/dev/null 2>&1); then
    echo "$CLI bench kernels"; else echo "$CLI bench"; fi
}
mla_cmd() {
  if (cd "$1" && PYTHONPATH="$1${PYTHONPATH#$ROOT}" $CLI bench mla --help 2>&1 | grep -q -- "--seq-len"); then
    echo "$CLI bench mla"; else echo "$PY -m pagedattn.bench.mla"; fi
}
KERNELS=$(kernels_cmd "$ROOT"); MLA=$(mla_cmd "$ROOT")
KERNELS_AB=""; MLA_AB=""
[ -n "$AB" ] && { KERNELS_AB=$(kernels_cmd "$AB"); MLA_AB=$(mla_cmd "$AB"); }
HOST=""; $CLI bench host --help 2>&1 | grep -q -- "--calls" && HOST="$CLI bench host"
E2E="$CLI bench e2e"
WAVES="$PY -m pagedattn.bench.waves"
PLOT="$PY -m pagedattn.bench.plot"
SWEEP="$PY $ROOT/scripts/gpu_prefill_sweep.py"
PARTS="$PY $ROOT/scripts/mixed_breakdown.py"
TEST_CMD="$PY -m pytest -m gpu -q -p no:cacheprovider"
MLA_ARGS="--batch 1 32 128 --seq-len 4096 32768"
Q=""; [ "$QUICK" = 1 ] && Q="--quick"

ON_GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
[ "$QUICK" = 0 ] && [ "$ON_GPU" = 0 ] && echo "gpu_run.sh: no CUDA GPU here; add --quick for the interpreter" >&2

# What this checkout's benchmark offers: its --list prints "<workload> <case>" and "provider <name>: available".
LIST=$($KERNELS --suite all --list $Q 2>/dev/null || $KERNELS --list $Q 2>/dev/null)
WORKLOADS=$(echo "$LIST" | awk '$1 != "provider" {print $1}' | sort -u | tr '\n' ' ')
AVAILABLE=$(echo "$LIST" | sed -n 's/^provider \([^: ]*\)\( (only when named)\)\{0,1\}: available$/\1/p' | tr '\n' ',')
has_workload() { [[ " $WORKLOADS " == *" $1 "* ]]; }
pick_providers() {  # the wanted providers that are available, then every available peer
  local want=$1 out="" p
  for p in ${want//,/ } $(echo "${AVAILABLE//,/ }" | tr ' ' '\n' | grep -E 'flashinfer|cudnn-paged|cudnn_paged|vllm' ); do
    [[ ",$AVAILABLE," == *",$p,"* ]] && [[ ",$out," != *",$p,"* ]] && out="$out,$p"
  done
  echo "${out#,}"
}
DECODE_PROVIDERS=$(pick_providers "${PROVIDERS:-pagedattn,pagedattn-persistent,sdpa-cudnn}")
PREFILL_PROVIDERS=$(pick_providers "${PROVIDERS:-pagedattn,sdpa-cudnn,sdpa-flash}")

# ---- steps ---------------------------------------------------------------------------------------
STATUS=()
step() {  # step NAME GPU_ONLY COMMAND...: run in this tree (and in --ab's tree), log, record the status
  local name=$1 gpu_only=$2; shift 2
  if [ "$gpu_only" = 1 ] && [ "$ON_GPU" = 0 ]; then STATUS+=("$name: skipped (needs a GPU)"); return; fi
  local i tree trees=cur; [ -n "$AB" ] && trees="cur ab"
  for ((i = 1; i <= REPEAT; i++)); do
    for tree in $trees; do
      local dir=$OUT sfx="" wd=$ROOT
      [ -n "$AB" ] && dir=$OUT/$tree
      [ "$REPEAT" -gt 1 ] && sfx=".$i"
      [ "$tree" = ab ] && wd=$AB
      mkdir -p "$dir"
      local cmd=() w k=$KERNELS m=$MLA
      [ "$tree" = ab ] && { k=$KERNELS_AB; m=$MLA_AB; }
      for w in "$@"; do  # @KERNELS@ / @MLA@: that tree's command; @OUT@ / @SFX@: where the files go
        case "$w" in @KERNELS@) cmd+=($k) ;; @MLA@) cmd+=($m) ;; *) w=${w//@OUT@/$dir}; cmd+=("${w//@SFX@/$sfx}") ;; esac
      done
      local t0=$SECONDS
      (cd "$wd" && PYTHONPATH="$wd${PYTHONPATH#$ROOT}" timeout "$TIMEOUT" "${cmd[@]}") > "$OUT/logs/$name.$tree$sfx.log" 2>&1
      local rc=$?
      STATUS+=("$name [$tree$sfx]: rc=$rc, $((SECONDS - t0)) s, log $OUT/logs/$name.$tree$sfx.log")
      echo "${STATUS[-1]}"
    done
  done
}
kernels() {  # kernels NAME PROVIDERS WORKLOADS
  step "$1" 0 @KERNELS@ --workload "$3" --provider "$2" $Q --json "@OUT@/$1@SFX@.json" --markdown "@OUT@/$1@SFX@.md"
}

if [ "$TESTS" = 1 ]; then
  if [ "$ON_GPU" = 0 ]; then STATUS+=("tests: skipped (needs a GPU; the interpreter suite is TRITON_INTERPRET=1 pytest)")
  else
    XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
    t0=$SECONDS
    timeout "$TIMEOUT" $TEST_CMD $XDIST > "$OUT/logs/tests.log" 2>&1
    STATUS+=("tests: rc=$?, $((SECONDS - t0)) s: $(tail -1 "$OUT/logs/tests.log")")
    echo "${STATUS[-1]}"; grep -E "^(FAILED|ERROR)" "$OUT/logs/tests.log" | head -20
  fi
fi

PEM=""
for b in ${BENCH//,/ }; do
  case "$b" in
    decode) kernels decode "$DECODE_PROVIDERS" decode ;;
    prefill|extend|mixed) PEM="$PEM,$b" ;;
    mixes) kernels mixes "$PREFILL_PROVIDERS" prefill-heavy,decode-heavy ;;
    models) if has_workload gemma3; then
              kernels models "$(pick_providers "${PROVIDERS:-pagedattn,pagedattn-graph}")" "gemma3$(has_workload llama3 && echo ,llama3)$(has_workload mistral && echo ,mistral)"
            else STATUS+=("models: to be measured (this checkout's benchmark has no gemma3 workload)"); fi ;;
    hetero|specdecode)
      if has_workload "$b"; then kernels "$b" "$DECODE_PROVIDERS" "$b"
      else STATUS+=("$b: to be measured (this checkout's benchmark has no $b workload)"); fi ;;
    heads) step prefill-heads 1 $SWEEP --variants paged --anchors sdpa-cudnn,sdpa-flash --graph --configs default \
             --heads 64,256 --lengths 2048,8192 --json "@OUT@/prefill-heads@SFX@.json" ;;
    autotune) step prefill-autotuned 0 env PAGEDATTN_AUTOTUNE=1 @KERNELS@ --workload prefill,extend,mixed \
                --provider pagedattn $Q --json "@OUT@/prefill-autotuned@SFX@.json" --markdown "@OUT@/prefill-autotuned@SFX@.md" ;;
    parts) step mixed-parts 0 $PARTS $Q --json "@OUT@/mixed-parts@SFX@.json" ;;
    mla) step mla 0 @MLA@ ${Q:-$MLA_ARGS} --json "@OUT@/mla@SFX@.json" ;;
    host) if [ -n "$HOST" ]; then step host 0 $HOST $Q --json "@OUT@/host@SFX@.json" --markdown "@OUT@/host@SFX@.md"
          else STATUS+=("host: to be measured (this checkout has no pagedattn bench host)"); fi ;;
    waves) step waves 1 $WAVES --json "@OUT@/waves@SFX@.json" --plot "@OUT@" ;;
    e2e) step e2e 0 $E2E $Q --json "@OUT@/e2e@SFX@.json" --markdown "@OUT@/e2e@SFX@.md" ;;
    *) echo "gpu_run.sh: unknown benchmark $b (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$PEM" ]; then  # one call: the ceilings and the warm-up are paid once
  PEM=${PEM#,}; kernels "${PEM//,/-}" "$PREFILL_PROVIDERS" "$PEM"
fi

# ---- plots and the summary -----------------------------------------------------------------------
if $PY -c "import matplotlib" 2>/dev/null; then
  for f in "$OUT"/decode.json "$OUT"/prefill*.json "$OUT"/cur/decode.json "$OUT"/cur/prefill*.json; do
    [ -f "$f" ] && [[ "$f" != *heads* ]] && $PLOT "$f" --out "$(dirname "$f")" >> "$OUT/logs/plot.log" 2>&1
  done
fi
{
  echo "# GPU run"
  echo
  $PY -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, ' + (torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (interpreter)'))" 2>/dev/null
  echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$( [ -n "$(git -C "$ROOT" status --porcelain -uno 2>/dev/null)" ] && echo ' (with uncommitted changes)'), $(date -u +%Y-%m-%dT%H:%MZ)"
  [ -n "$AB" ] && echo "A/B: cur = this tree, ab = $AB"
  echo "providers: decode $DECODE_PROVIDERS; prefill $PREFILL_PROVIDERS"
  echo
  printf -- '- %s\n' "${STATUS[@]}"
  echo
  $PY "$ROOT/scripts/results_table.py" "$OUT"
} | tee "$OUT/summary.md"
