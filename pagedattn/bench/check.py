"""Correctness gate: each provider's output against ``paged_attention_ref`` before it is timed.

Large cases are checked on a subset: the first two and the last sequence, and at most the last
256 query rows of each (the rows that see the most keys). Taking a sequence's *last* rows keeps
the position rule of the reference, so the subset is an ordinary, smaller reference call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedattn.bench.workloads import CaseInputs

# Absolute tolerance on outputs for unit-variance random inputs.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}

FULL_CHECK_WORK = 2**24  # query-key-head products below which every row is checked
FP64_WORK = 2**28  # above this, the GPU reference computes in float32


@dataclass
class Reference:
    rows: torch.Tensor  # [n] int64 token indices that were checked
    out: torch.Tensor  # [n, num_q_heads, head_size], float32 or float64
    what: str  # which rows, in words


def _work(query_lens, seq_lens, heads) -> int:
    return sum(q * kv for q, kv in zip(query_lens, seq_lens)) * heads


def reference(inputs: CaseInputs, *, max_rows: int = 256) -> Reference:
    from pagedattn.reference import paged_attention_ref

    case = inputs.case
    query_lens, seq_lens = case.query_lens, case.seq_lens
    heads = case.params["num_q_heads"]
    n = case.num_seqs
    if _work(query_lens, seq_lens, heads) <= FULL_CHECK_WORK:
        seqs, rows_per = list(range(n)), query_lens
        what = "all rows"
    else:
        seqs = sorted({0, min(1, n - 1), n - 1})
        rows_per = [min(query_lens[s], max_rows) for s in range(n)]
        what = f"sequences {seqs}, last <= {max_rows} rows each"

    qsl = inputs.query_start_loc.tolist()
    rows = torch.cat([torch.arange(qsl[s + 1] - rows_per[s], qsl[s + 1]) for s in seqs])
    sub_q = [rows_per[s] for s in seqs]
    sub_qsl = torch.tensor([0] + torch.tensor(sub_q).cumsum(0).tolist(), dtype=torch.int32)
    work = _work(sub_q, [seq_lens[s] for s in seqs], heads)
    on_gpu = inputs.q.device.type != "cpu"
    compute_dtype = torch.float32 if on_gpu and work > FP64_WORK else torch.float64

    dev = inputs.q.device
    sel = torch.tensor(seqs, device=dev)
    features = dict(inputs.features)
    out, _ = paged_attention_ref(
        inputs.q[rows.to(dev)],
        inputs.k_cache,
        inputs.v_cache,
        inputs.block_table[sel],
        inputs.seq_lens[sel],
        sub_qsl.to(dev),
        compute_dtype=compute_dtype,
        **features,
    )
    return Reference(rows=rows, out=out, what=f"{what} ({str(compute_dtype).removeprefix('torch.')})")


def compare(out_tokens: torch.Tensor, ref: Reference) -> tuple[float, bool, float]:
    """(max abs error, within tolerance, tolerance); NaN/inf in the output fail."""
    tol = TOLERANCE[out_tokens.dtype]
    got = out_tokens[ref.rows.to(out_tokens.device)].to(ref.out.dtype)
    err = float((got - ref.out).abs().max()) if got.numel() else 0.0
    ok = math.isfinite(err) and err <= tol
    return err, ok, tol
