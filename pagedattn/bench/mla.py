"""``python -m pagedattn.bench.mla``: MLA decode (128 heads, B 1/32/128 x L 4096/32768) beside torch ops on a contiguous latent.

Cases: 128 heads, 512 latent + 64 rope, bf16, page 16, B in {1, 32, 128} x L in {4096, 32768}
(skipping B*L > 4M). Bytes = B*L*576*2 (the latent a call must read, at bf16); FLOPs =
2 * B * query_len * heads * L * (576 + 512) (score and output dots). Both providers run in the
same process and are timed by :func:`pagedattn.bench.timing.bench` (CUDA-graph replays
rotating over input copies for short calls, ``do_bench`` otherwise):

* ``pagedattn``: :func:`pagedattn.mla_decode` over the paged cache (host maxima given: no sync);
* ``pagedattn-gluon`` (on compute capability 9.x with Triton's Gluon, unless ``--config`` is
  given): the same call through the sm90 Gluon kernel, warp-specialized (``PAGEDATTN_MLA_GLUON=1``,
  set for this row only; ``--gluon 1,sync,n32`` adds rows for the older kernel's kept variants,
  ``pagedattn-gluon-sync`` and ``pagedattn-gluon-n32``); its split count is the rule's, so the
  splits column may differ. The ``pagedattn`` row is the
  portable kernel in the config the planner picks for it;
* ``torch``: ``einsum`` scores + fp32 softmax + ``einsum`` output over a contiguous
  ``[B, L, 576]`` copy of the same latents;
* ``flashinfer`` (when installed, on a GPU): ``flashinfer.mla.BatchMLAPagedAttentionWrapper``
  over the same paged cache, latent and rope parts as two views of it, planned once per case
  outside the timing (:mod:`pagedattn.adapters.flashinfer`);
* ``flashmla`` (vLLM installed, on sm90): FlashMLA's dense decode as vLLM's wheel ships it
  (``flash_mla_with_kvcache``, AOT-compiled) over the same paged cache with one KV head, q as
  ``[B, query_len, heads, 576]``; its tile-scheduler metadata is made by a first call outside
  the timing (:mod:`pagedattn.adapters.vllm_kernels`). FlashMLA reads 64-token pages only:
  run with ``--block-size 64`` (other sizes are listed as skipped).

Both peers are checked against the fp32 torch result before they are timed; a case a peer
cannot run is listed with the reason. ``--no-peers`` skips both.

``--sweep`` times a grid of kernel configs (``SWEEP_CONFIGS``: heads per program, value split,
keys per tile, warps, stages; plus split counts around the rule's for B=1) on every case,
checks each output against the torch baseline once, prints progress, a table and the best
config per case, and writes JSON (``--json``, default ``bench_out/mla-sweep.json``). It also measures the
ceilings (a large read, a bf16 matmul) in the same run. Configs whose accumulator or shared
memory cannot fit (``MLAConfig.problems``) are skipped and listed. The B >= 32 cases run first
and runs past ``--time-budget`` seconds (default 225) are skipped and listed, so the sweep
stays under ~4 minutes on an H200 (expected: ~2-3 minutes, about half of it compilation).

Without a GPU the Triton interpreter runs a tiny ``--quick`` configuration; those times only
show that the script runs. ``--config`` and ``--num-splits`` fix the kernel's choices.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pagedattn.bench.cli import select_device
from pagedattn.testing import TOLERANCES

PEAK_TBPS = 4.6  # H200 decode ceiling used in PERFORMANCE.md (cuDNN reads at 4.64 TB/s)
MAX_TOKENS = 4 * 1024 * 1024
LATENT, ROPE = 512, 64
BF16_TOLERANCE = TOLERANCES[torch.bfloat16][0]  # max |pagedattn - torch fp32| accepted in the sweep
SCALE = 192**-0.5


def sweep_configs():
    """The sweep grid for 128 heads (12 configs; see docs/perf-notes.md, "MLA").

    64 rows on two warp groups (the default: whole accumulator, scores computed by both groups,
    2 readers per tile), 64 rows on one warp group with 2 or 4 value parts (4 or 8 readers),
    128 rows on two warp groups with 2 value parts, and the 32/16-row mma.sync programs (the
    shape vLLM's Triton MLA kernel uses); the last one is an older 32-row tiling, kept as a baseline.
    """
    from pagedattn.ops.mla.config import MLAConfig as C

    return [
        C(64, 1, 64, 1, 8, 2),  # the default (bf16 / fp16 cache)
        C(64, 1, 32, 1, 8, 4),
        C(64, 1, 32, 2, 4, 4),  # the default for an fp8 cache
        C(64, 1, 32, 2, 4, 3),
        C(64, 1, 64, 2, 4, 2),
        C(64, 1, 32, 4, 4, 4),
        C(64, 1, 64, 4, 4, 2),
        C(128, 1, 16, 2, 8, 4),
        C(128, 1, 32, 2, 8, 2),
        C(32, 1, 32, 2, 4, 4),
        C(16, 1, 32, 1, 4, 4),
        C(64, 1, 32, 1, 8, 2),  # the tiling before the restructure
    ]


SPLIT_FACTORS = (0.5, 2.0, 4.0)  # B=1 cases also run the default config at these multiples of the rule's splits


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedattn.bench.mla", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 32 128; --quick: 1 2)")
    p.add_argument("--seq-len", type=int, nargs="+", help="context lengths (default 4096 32768; --quick: 64 200)")
    p.add_argument("--heads", type=int, help="query heads (default 128; --quick: 16)")
    p.add_argument("--query-len", type=int, default=1, help="query tokens per sequence (speculative: up to 8)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fp8", action="store_true", help="fp8 e4m3 latent cache for pagedattn (bytes still at bf16)")
    p.add_argument("--num-splits", type=int, help="force the split count (default: the launcher's rule)")
    p.add_argument("--config", help="force the kernel config: BLOCK_H,BLOCK_Q,TILE_N,VALUE_SPLIT,NUM_WARPS,NUM_STAGES")
    p.add_argument("--sweep", action="store_true", help="time the config grid on every case (see the module doc)")
    p.add_argument("--time-budget", type=float, default=225.0,
                   help="--sweep: seconds after which the remaining runs are skipped (and listed)")
    p.add_argument("--gluon", default="1",
                   help="comma list of PAGEDATTN_MLA_GLUON values timed as pagedattn-gluon rows on sm90 (1: the "
                        "default config, warp-specialized; sync / n32: the older kernel's kept variants; '': none; "
                        "default 1)")
    p.add_argument("--no-baseline", action="store_true", help="skip the torch provider")
    p.add_argument("--no-peers", action="store_true", help="skip the peers (FlashInfer's MLA wrapper, FlashMLA)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the default without a GPU)")
    p.add_argument("--json", help="also write the records to this file (--sweep: default bench_out/mla-sweep.json)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_config(text: str):
    from pagedattn.ops.mla.config import MLAConfig

    block_h, block_q, tile_n, value_split, num_warps, num_stages = (int(x) for x in text.split(","))
    return MLAConfig(block_h, block_q, tile_n, value_split, num_warps, num_stages)


def _paged_inputs(batch, seq_len, query_len, heads, block_size, dtype, cache_dtype, device, g):
    """(q, kv_cache, block_table, seq_lens, query_start_loc, latent): latent is the contiguous copy."""
    pages = -(-seq_len // block_size)
    num_blocks = batch * pages + 1
    if device.type == "cuda":  # large caches: random data made on the device
        kv = torch.randn(num_blocks, block_size, LATENT + ROPE, device=device, dtype=dtype)
    else:
        kv = torch.randn(num_blocks, block_size, LATENT + ROPE, generator=g, dtype=torch.float32).to(device, dtype)
    block_table = torch.randperm(num_blocks, generator=g)[: batch * pages].view(batch, pages).to(device, torch.int32)
    latent = kv[block_table.long()].reshape(batch, pages * block_size, LATENT + ROPE)[:, :seq_len].contiguous()
    q = torch.randn(batch * query_len, heads, LATENT + ROPE, generator=g).to(device, dtype)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    qsl = (torch.arange(batch + 1, dtype=torch.int32) * query_len).to(device)
    return q, kv.to(cache_dtype), block_table, seq_lens, qsl, latent


def torch_mla(q, latent, scale, query_len):
    """Composed torch decode over a contiguous latent [B, L, 576]; causal within the new tokens."""
    batch, seq_len = latent.shape[:2]
    qb = q.view(batch, query_len * q.shape[1], q.shape[2])  # [B, q_len * H, 576]
    s = torch.einsum("bmd,bld->bml", qb, latent).float() * scale
    if query_len > 1:
        heads = q.shape[1]
        q_pos = seq_len - query_len + torch.arange(query_len, device=q.device).repeat_interleave(heads)
        s = s.masked_fill(torch.arange(seq_len, device=q.device)[None, None, :] > q_pos[None, :, None],
                          float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    out = torch.einsum("bml,bld->bmd", p, latent[..., :LATENT])
    return out.view(batch * query_len, q.shape[1], LATENT)


class Workload:
    """One (B, L) case: rotated input copies, output buffers and the fp32 torch check."""

    def __init__(self, batch, seq_len, args, device, dtype, g):
        from pagedattn.bench.timing import copies_for

        self.batch, self.seq_len, self.args, self.device, self.dtype = batch, seq_len, args, device, dtype
        self.heads, self.ql = args.heads, args.query_len
        cache_dtype = torch.float8_e4m3fn if args.fp8 else dtype
        self.nbytes = batch * seq_len * (LATENT + ROPE) * 2
        self.flops = 2 * batch * self.ql * self.heads * seq_len * (LATENT + ROPE + LATENT)
        self.copies = copies_for(self.nbytes, device)
        self.sets = [_paged_inputs(batch, seq_len, self.ql, self.heads, args.block_size, dtype, cache_dtype, device, g)
                     for _ in range(self.copies)]
        self.outs = [torch.empty(batch * self.ql, self.heads, LATENT, dtype=dtype, device=device) for _ in self.sets]
        self.kv_scale = torch.ones(1, device=device) if args.fp8 else None
        q0, latent0 = self.sets[0][0], self.sets[0][5]
        self.check = torch_mla(q0.float(), latent0.float(), SCALE, self.ql)  # fp32, same latents (pre-fp8)

    def record(self, provider, timing, err, **extra):
        us = timing["time_us"]
        gbps = self.nbytes / (us * 1e-6) / 1e9
        return {
            "B": self.batch, "L": self.seq_len, "query_len": self.ql, "heads": self.heads, "provider": provider,
            "time_us": us, "gbps": gbps, "pct_peak": 100 * gbps / (PEAK_TBPS * 1e3),
            "tflops": self.flops / (us * 1e-6) / 1e12, "method": timing["method"], "max_err_vs_torch": err,
            "fp8": bool(self.args.fp8 and provider != "torch"), **extra,
        }

    def _timed(self, **call):
        """(timing, max error against the torch check) of ``_mla_decode`` over every input copy,
        with ``call``'s keywords; the first call compiles, then the check."""
        from pagedattn.bench.timing import bench
        from pagedattn.mla import _mla_decode

        def paged_fn(i):
            q, kv, bt, lens, qsl, _ = self.sets[i]
            return lambda: _mla_decode(q[..., :LATENT], q[..., LATENT:], kv, bt, lens, qsl, scale=SCALE,
                                       max_query_len=self.ql, max_seq_len=self.seq_len, out=self.outs[i], **call)

        fns = [paged_fn(i) for i in range(self.copies)]
        err = float((fns[0]().float() - self.check).abs().max())
        return bench(fns, self.device), err

    def time_paged(self, config, num_splits):
        """Record of pagedattn with this config (num_splits None: the config's, else the rule's)."""
        from pagedattn.plan import choose_mla_splits, num_sms, resolve_mla_config

        config = resolve_mla_config(config, self.heads, self.ql, fp8_cache=self.args.fp8, num_seqs=self.batch,
                                    sms=num_sms(self.device))
        splits = num_splits or config.num_splits or choose_mla_splits(
            self.batch, self.heads, self.ql, self.seq_len, config, num_sms(self.device))
        timing, err = self._timed(kv_scale=self.kv_scale, num_splits=splits, config=config)
        return self.record("pagedattn", timing, err, config=config.label, num_splits=splits,
                           tiles=[config.block_h, config.block_q, config.tile_n, config.value_split,
                                  config.num_warps, config.num_stages])

    def time_gluon(self, num_splits, variant="1"):
        """Record of pagedattn's Gluon kernel in the config ``PAGEDATTN_MLA_GLUON=variant`` names
        (set for this row only), or None where it does not serve this case (not sm9x, no Gluon,
        fp8, more than one query token)."""
        from pagedattn.ops.mla_gluon.launch import GLUON_ENV, use_gluon_mla
        from pagedattn.testing import environ_set

        q, kv = self.sets[0][0], self.sets[0][1]
        with environ_set(GLUON_ENV, variant):
            config = use_gluon_mla(q[..., :LATENT], q[..., LATENT:], kv, self.ql)
            if config is None:
                return None
            timing, err = self._timed(num_splits=num_splits)
        name = "pagedattn-gluon" if variant == "1" else f"pagedattn-gluon-{variant}"
        return self.record(name, timing, err, config=config.label, num_splits=num_splits, tiles=None)

    def time_flashinfer(self):
        """(record or None, message): FlashInfer's MLA wrapper on the same paged latents."""
        from pagedattn.adapters import flashinfer

        return self._time_peer("flashinfer", flashinfer.availability, flashinfer.mla_call,
                               fp8="FlashInfer's per-tensor scales are not wired")

    def time_flashmla(self):
        """(record or None, message): FlashMLA's dense decode (vLLM's build) on the same paged latents."""
        from pagedattn.adapters import vllm_kernels

        def check():
            ok, why = vllm_kernels.flashmla_availability()
            if ok:  # a block size FlashMLA does not read is a skip, not a failure
                ok, why = vllm_kernels.flashmla_supports(block_size=self.args.block_size, dtype=self.dtype,
                                                         row_dim=LATENT + ROPE, latent_dim=LATENT)
                if self.args.block_size != vllm_kernels.FLASHMLA_BLOCK_SIZE:
                    why += f" (run with --block-size {vllm_kernels.FLASHMLA_BLOCK_SIZE})"
            return ok, why

        return self._time_peer("flashmla", check, vllm_kernels.flashmla_call,
                               fp8="FlashMLA's fp8 cache is its own packed layout, not wired")

    def _time_peer(self, provider, availability, call, *, fp8):
        """(record or None, message): a peer's ``call`` (an adapter's MLA call) on every input copy.

        The output is checked against the fp32 torch result before timing; a mismatch or a
        case the peer cannot prepare gives no record and a message saying why.
        """
        from pagedattn.bench.timing import bench, host_time_us

        label = f"{provider} B={self.batch} L={self.seq_len}"
        ok, why = availability()
        if not ok:
            return None, f"{label}: skipped ({why})"
        if self.args.fp8:
            return None, f"{label}: skipped (fp8 latent cache: {fp8})"
        fns, note = [], ""
        try:
            for i, (q, kv, bt, lens, qsl, _) in enumerate(self.sets):
                run, note = call(q, kv, bt, lens, qsl, scale=SCALE, latent_dim=LATENT, out=self.outs[i])
                fns.append(run)
            self.outs[0].fill_(float("nan"))
            err = float((fns[0]().float() - self.check).abs().max())
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported, not fatal
            return None, f"{label}: not run ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        if not err <= BF16_TOLERANCE:
            return None, f"{label}: max error {err:.3g} vs torch > {BF16_TOLERANCE:g}, not timed"
        host = host_time_us(fns[0]) if self.device.type == "cuda" else None
        record = self.record(provider, bench(fns, self.device), err, config=note, num_splits=None, tiles=None,
                             host_us=host)
        record["ok"] = True
        return record, ""

    def time_torch(self):
        from pagedattn.bench.timing import bench

        fns = [lambda s=s: torch_mla(s[0], s[5], SCALE, self.ql) for s in self.sets]
        err = float((fns[0]().float() - self.check).abs().max())
        return self.record("torch", bench(fns, self.device), err, config=None, num_splits=None, tiles=None)


def _cases(args):
    return [(b, seq) for seq in args.lens for b in args.batches if b * seq <= MAX_TOKENS]


def run_plain(args, device, dtype, g) -> list[dict]:
    config = parse_config(args.config) if args.config else None
    records = []
    for batch, seq_len in _cases(args):
        w = Workload(batch, seq_len, args, device, dtype, g)
        records.append(w.time_paged(config, args.num_splits))
        if config is None:
            for variant in args.gluon.split(",") if args.gluon else ():
                gluon = w.time_gluon(args.num_splits, variant)
                if gluon is not None:
                    records.append(gluon)
        if not args.no_baseline:
            records.append(w.time_torch())
        if not args.no_peers:
            for record, message in (w.time_flashinfer(), w.time_flashmla()):
                if record is not None:
                    records.append(record)
                elif message:
                    print(message, file=sys.stderr, flush=True)
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def run_sweep(args, device, dtype, g) -> list[dict]:
    """Every config of the grid (and split variants at B=1) on every case; progress on stdout."""
    from pagedattn.plan import choose_mla_splits, num_sms, resolve_mla_config

    configs = [parse_config(args.config)] if args.config else sweep_configs()
    runnable = []
    for c in configs:
        problems = c.problems()
        if problems and device.type == "cuda":
            print(f"skip {c.label}: {'; '.join(problems)}", flush=True)
        else:
            runnable.append(c)
    # the large cases (B >= 32) first, in case the time budget cuts the sweep short
    cases = sorted(_cases(args), key=lambda c: (c[0] < 32, c[0] * c[1]))
    t0 = time.perf_counter()
    records = []
    for n, (batch, seq_len) in enumerate(cases, 1):
        w = Workload(batch, seq_len, args, device, dtype, g)
        runs = [(c, args.num_splits) for c in runnable]
        if batch == 1 and args.num_splits is None:  # split counts around the rule's, default config
            default = resolve_mla_config(None, args.heads, args.query_len, fp8_cache=args.fp8, num_seqs=batch,
                                         sms=num_sms(device))
            rule = choose_mla_splits(batch, args.heads, args.query_len, seq_len, default, num_sms(device))
            runs += [(default, k) for k in sorted({max(2, round(rule * f)) for f in SPLIT_FACTORS} - {rule})]
        if not args.no_baseline:
            records.append(w.time_torch())
            r = records[-1]
            print(f"[{time.perf_counter() - t0:6.1f}s] case {n}/{len(cases)} B={batch} L={seq_len}: torch "
                  f"{r['time_us']:.1f} us", flush=True)
        if not args.no_peers:
            for r, message in (w.time_flashinfer(), w.time_flashmla()):
                if r is not None:
                    records.append(r)
                    message = (f"{r['provider']} {r['time_us']:.1f} us, {r['tflops']:.0f} TFLOP/s, host "
                               f"{_host(r)} us, err {r['max_err_vs_torch']:.2g} ({r['config']})")
                print(f"[{time.perf_counter() - t0:6.1f}s] case {n}/{len(cases)} B={batch} L={seq_len}: {message}",
                      flush=True)
        for i, (config, splits) in enumerate(runs, 1):
            if time.perf_counter() - t0 > args.time_budget:
                print(f"[{time.perf_counter() - t0:6.1f}s] time budget ({args.time_budget:.0f}s) spent: skipping "
                      f"B={batch} L={seq_len} {config.label} splits={splits or 'rule'}", flush=True)
                continue
            try:
                r = w.time_paged(config, splits)
            except Exception as e:  # noqa: BLE001 - one config failing must not stop the sweep
                print(f"[{time.perf_counter() - t0:6.1f}s] B={batch} L={seq_len} {config.label}: FAILED "
                      f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                continue
            r["ok"] = r["max_err_vs_torch"] <= BF16_TOLERANCE or device.type == "cpu"
            records.append(r)
            print(f"[{time.perf_counter() - t0:6.1f}s] B={batch} L={seq_len} ({i}/{len(runs)}) {r['config']} "
                  f"splits={r['num_splits']}: {r['time_us']:.1f} us, {r['gbps']:.0f} GB/s "
                  f"({r['pct_peak']:.1f}%), {r['tflops']:.0f} TFLOP/s, err {r['max_err_vs_torch']:.2g}"
                  f"{'' if r['ok'] else '  MISMATCH'}", flush=True)
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def best_per_case(records) -> list[dict]:
    best = {}
    for r in records:
        if r["provider"] != "pagedattn" or not r.get("ok", True):
            continue
        key = (r["B"], r["L"])
        if key not in best or r["time_us"] < best[key]["time_us"]:
            best[key] = r
    return [best[k] for k in sorted(best, key=lambda k: (k[1], k[0]))]


def _host(record) -> str:
    host = record.get("host_us")
    return f"{host:.1f}" if host is not None else "-"


def markdown(records) -> str:
    lines = [
        "| B x L | provider | config | splits | µs | GB/s | % of 4.6 TB/s | TFLOP/s | host µs | method | max err vs torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['B']} x {r['L']} | {r['provider']}{' (fp8)' if r['fp8'] else ''} | {r['config'] or '-'} | "
            f"{r['num_splits'] or '-'} | {r['time_us']:.1f} | {r['gbps']:.0f} | {r['pct_peak']:.1f} | "
            f"{r['tflops']:.0f} | {_host(r)} | {r['method']} | {r['max_err_vs_torch']:.3g}"
            f"{'' if r.get('ok', True) else ' ✗'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = select_device()
    quick = args.quick or device.type == "cpu"
    args.heads = args.heads or (16 if quick else 128)
    args.batches = args.batch or ([1, 2] if quick else [1, 32, 128])
    args.lens = args.seq_len or ([64, 200] if quick else [4096, 32768])
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter has no bf16 dot
    g = torch.Generator().manual_seed(args.seed)
    import triton

    from pagedattn.bench.ceilings import measure_ceilings

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    header = (f"MLA decode, {args.heads} heads, {LATENT}+{ROPE} latent, {str(dtype).replace('torch.', '')}, "
              f"page {args.block_size}, query_len {args.query_len}; {gpu}, torch {torch.__version__}, "
              f"triton {triton.__version__}; bytes = B*L*576*2, FLOPs = 2*B*q*H*L*1088")
    ceilings = {}
    if args.sweep:
        print(header, flush=True)
        ceilings = measure_ceilings(device)
        if ceilings:
            print(f"ceilings: read {ceilings['read_gbps']:.0f} GB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} "
                  "TFLOP/s", flush=True)
        records = run_sweep(args, device, dtype, g)
    else:
        records = run_plain(args, device, dtype, g)
    if not args.sweep:
        print(header)
    print(markdown(records))
    best = best_per_case(records) if args.sweep else []
    if args.sweep:
        baseline = {(r["B"], r["L"]): r for r in records if r["provider"] == "torch"}
        peers = [{(r["B"], r["L"]): r for r in records if r["provider"] == name} for name in ("flashinfer", "flashmla")]
        print("\nBest config per case:")
        print(markdown(best))
        for r in best:
            others = [baseline.get((r["B"], r["L"]))] + [peer.get((r["B"], r["L"])) for peer in peers]
            vs = [f"{x['time_us'] / r['time_us']:.2f}x {x['provider']}" for x in others if x]
            if vs:
                print(f"B={r['B']} L={r['L']}: {r['config']} " + ", ".join(vs))
    path = args.json or ("bench_out/mla-sweep.json" if args.sweep else None)
    if path:
        from pagedattn.bench.report import write_json

        results = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, ceilings=ceilings,
                       records=records, best=best)
        print(f"wrote {write_json(results, path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
