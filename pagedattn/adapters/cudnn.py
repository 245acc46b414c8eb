"""cuDNN's own paged attention: one SDPA graph (cudnn-frontend) over pagedattn's cache tensors.

The graph reads K and V through page tables (``paged_attention_k_table`` /
``paged_attention_v_table``, both pagedattn's block table viewed ``[num_seqs, 1, max_blocks,
1]``) from the cache pagedattn writes, ``[num_blocks, block_size, num_kv_heads, head_size]``,
declared to cuDNN as the permuted view ``[num_blocks, num_kv_heads, block_size, head_size]``
(cuDNN's container order; strides, no copy). Per-sequence lengths ``seq_lens`` and the query
lengths give the padding mask; queries after the first of a sequence take the bottom-right
causal mask (query j of a sequence of q queries and L keys sees keys 0 .. L - q + j).

A batch whose sequences all have the same query length is a dense ``[num_seqs, num_q_heads,
query_len, head_size]`` view of q and out. A batch with different query lengths (a mixed
batch) is one call with ragged Q and O: per-sequence element offsets (``query_start_loc *
num_q_heads * head_size``) on a graph declared at the longest query.

Graphs are built once per shape (cuDNN picks and compiles a plan, outside the timed call) and
shared by every batch of that shape; the call sets the handle's stream to the current one
(the stream CUDA-graph capture records on) and executes with the batch's pointers. Used by the
benchmark's ``cudnn-paged`` provider (:mod:`pagedattn.bench.providers`). cuDNN's attention
through torch's SDPA (``SDPBackend.CUDNN_ATTENTION``) is :mod:`pagedattn.adapters.sdpa`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedattn.adapters.common import NotApplicable, first_failure, gpu_status, module_status, query_lens_of

MIN_BACKEND = 90500  # cuDNN 9.5: paged K/V in the SDPA forward graph
DTYPES = (torch.float16, torch.bfloat16)

# tensor ids of the graph
Q, K, V, O = 1, 2, 3, 4
SEQ_LEN_Q, SEQ_LEN_KV = 10, 11
TABLE_K, TABLE_V = 20, 21
RAGGED_Q, RAGGED_O = 30, 31

_HANDLES: dict[tuple, object] = {}
_GRAPHS: dict[tuple, "_Graph"] = {}


def availability() -> tuple[bool, str]:
    """(can run here, why not): a CUDA GPU, cudnn-frontend, and a cuDNN backend with paged K/V."""
    ok, why = first_failure(gpu_status, lambda: module_status("cudnn"))
    if not ok:
        return ok, why
    import cudnn

    backend = int(cudnn.backend_version())
    if backend < MIN_BACKEND:
        return False, f"cuDNN backend {backend} is older than {MIN_BACKEND} (paged K/V in SDPA)"
    return True, ""


def version() -> str:
    import cudnn

    return f"cudnn-frontend {getattr(cudnn, '__version__', '?')}, cuDNN {cudnn.backend_version()}"


def supports(features, num_q_heads: int, num_kv_heads: int) -> tuple[bool, str]:
    """(can the graph here compute it, why not): ``features``, the names of the score
    modifiers and masks a call uses beside causal."""
    if features:
        return False, f"the paged SDPA graph here wires no {', '.join(sorted(features))}"
    if num_q_heads % num_kv_heads:
        return False, "num_q_heads is not a multiple of num_kv_heads"
    return True, ""


def _handle(device: torch.device):
    import cudnn

    key = (device.type, device.index)
    handle = _HANDLES.get(key)
    if handle is None:
        with torch.cuda.device(device):
            handle = _HANDLES[key] = cudnn.create_handle()
    return handle


def _cudnn_dtype(dtype: torch.dtype):
    import cudnn

    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


@dataclass(frozen=True)
class GraphShape:
    """Everything a built graph fixes; batches that agree on it share the graph."""

    num_seqs: int
    query_len: int  # the longest query (all of them when not ragged)
    max_seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    max_blocks: int  # block_table columns
    dtype: torch.dtype
    ragged: bool
    causal: bool
    scale: float


@dataclass
class _Graph:
    graph: object
    workspace: torch.Tensor


def _dense_bhsd(shape: GraphShape, heads: int) -> tuple[list[int], list[int]]:
    """dims and strides of ``[num_seqs, heads, query_len, head_size]`` over a token-major
    ``[num_tokens, heads, head_size]`` buffer."""
    s, d = shape.query_len, shape.head_size
    return [shape.num_seqs, heads, s, d], [s * heads * d, d, heads * d, 1]


def build_graph(shape: GraphShape, device: torch.device) -> _Graph:
    import cudnn

    io = _cudnn_dtype(shape.dtype)
    i32 = cudnn.data_type.INT32
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_handle(device))
    b, hq, hk, d = shape.num_seqs, shape.num_q_heads, shape.num_kv_heads, shape.head_size
    q_dim, q_stride = _dense_bhsd(shape, hq)
    q = g.tensor(name="q", dim=q_dim, stride=q_stride, data_type=io, uid=Q)
    nb, bs = shape.num_blocks, shape.block_size
    cache_dim, cache_stride = [nb, hk, bs, d], [bs * hk * d, d, hk * d, 1]  # NHD pages, heads first
    k = g.tensor(name="k_cache", dim=cache_dim, stride=cache_stride, data_type=io, uid=K)
    v = g.tensor(name="v_cache", dim=cache_dim, stride=cache_stride, data_type=io, uid=V)
    pages = shape.max_blocks
    table = dict(dim=[b, 1, pages, 1], stride=[pages, pages, 1, 1], data_type=i32)
    table_k = g.tensor(name="block_table_k", uid=TABLE_K, **table)
    table_v = g.tensor(name="block_table_v", uid=TABLE_V, **table)
    lens = dict(dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    seq_len_q = g.tensor(name="seq_len_q", uid=SEQ_LEN_Q, **lens)
    seq_len_kv = g.tensor(name="seq_len_kv", uid=SEQ_LEN_KV, **lens)
    ragged_o = None
    if shape.ragged:
        offsets = dict(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
        q.set_ragged_offset(g.tensor(name="ragged_q", uid=RAGGED_Q, **offsets))
        ragged_o = g.tensor(name="ragged_o", uid=RAGGED_O, **offsets)
    mask = dict(use_causal_mask_bottom_right=True) if shape.causal else {}
    o, _ = g.sdpa(
        name="paged_sdpa", q=q, k=k, v=v, attn_scale=shape.scale, generate_stats=False,
        use_padding_mask=True, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
        paged_attention_k_table=table_k, paged_attention_v_table=table_v,
        paged_attention_max_seq_len_kv=shape.max_seq_len, compute_data_type=cudnn.data_type.FLOAT, **mask,
    )
    o.set_uid(O).set_output(True).set_dim(q_dim).set_stride(q_stride).set_data_type(io)
    if ragged_o is not None:
        o.set_ragged_offset(ragged_o)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    workspace = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=device)
    return _Graph(g, workspace)


def _graph(shape: GraphShape, device: torch.device) -> _Graph:
    key = (shape, device.type, device.index)
    entry = _GRAPHS.get(key)
    if entry is None:
        entry = _GRAPHS[key] = build_graph(shape, device)
    return entry


def graph_shape(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, causal=True,
                features=None) -> GraphShape:
    """The graph a call needs (raises NotApplicable for what the graph here cannot do);
    ``features``: the call's other keyword features, name -> value (None: off)."""
    if q.dtype not in DTYPES:
        raise NotApplicable(f"cuDNN's paged SDPA takes fp16/bf16, not {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise NotApplicable("K/V cache dtype differs from q's (no fp8 scales wired)")
    extra = sorted(k for k, v in (features or {}).items() if v is not None)
    if extra:
        raise NotApplicable(f"the paged SDPA graph here wires no {', '.join(extra)}")
    q_lens = query_lens_of(query_start_loc.tolist())
    if min(q_lens) < 1:
        raise NotApplicable("a sequence without query tokens (cuDNN's padding mask needs >= 1)")
    lens = seq_lens.tolist()
    if any(n > kv for n, kv in zip(q_lens, lens)):
        raise ValueError("a query is longer than its sequence")
    return GraphShape(
        num_seqs=len(q_lens), query_len=max(q_lens), max_seq_len=max(lens), num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2], head_size=q.shape[2], num_blocks=k_cache.shape[0],
        block_size=k_cache.shape[1], max_blocks=block_table.shape[1], dtype=q.dtype,
        ragged=len(set(q_lens)) > 1, causal=bool(causal) and max(q_lens) > 1,
        scale=1.0 / math.sqrt(q.shape[2]),
    )


def paged_call(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, out, causal=True, features=None):
    """(zero-argument call, note): cuDNN's paged SDPA on pagedattn's tensors, writing ``out``
    (like q). The graph is built here (once per shape); the call only executes it."""
    import cudnn

    shape = graph_shape(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, causal=causal,
                        features=features)
    device = q.device
    entry = _graph(shape, device)
    b, hq, d = shape.num_seqs, shape.num_q_heads, shape.head_size
    qsl = query_start_loc.to(torch.int32)
    q_lens = (qsl[1:] - qsl[:-1]).contiguous().view(b, 1, 1, 1)
    if shape.ragged:
        q_buf, o_buf = q, out  # the ragged offsets address the rows
    else:
        q_buf = q.view(b, shape.query_len, hq, d).transpose(1, 2)
        o_buf = out.view(b, shape.query_len, hq, d).transpose(1, 2)
    table = block_table.contiguous().view(b, 1, shape.max_blocks, 1)
    pack = {
        Q: q_buf, O: o_buf,
        K: k_cache.permute(0, 2, 1, 3), V: v_cache.permute(0, 2, 1, 3),
        TABLE_K: table, TABLE_V: table,
        SEQ_LEN_Q: q_lens, SEQ_LEN_KV: seq_lens.contiguous().view(b, 1, 1, 1),
    }
    if shape.ragged:
        offsets = (qsl * (hq * d)).contiguous().view(b + 1, 1, 1, 1)
        pack[RAGGED_Q] = offsets
        pack[RAGGED_O] = offsets
    graph, workspace, handle = entry.graph, entry.workspace, _handle(device)

    def run():
        cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
        graph.execute(pack, workspace, handle=handle)
        return out

    layout = f"ragged Q/O ({b} sequences, longest {shape.query_len})" if shape.ragged else "dense Q/O"
    return run, f"one paged SDPA graph call, {layout}"
