"""Peer providers on the CPU: gating, metadata conversion, and the adapters against fakes.

FlashInfer and cuDNN run only on a GPU. Here each adapter drives a small fake of the peer's API
that computes attention from exactly what the adapter hands it (page lists, declared dims and
strides, page tables, ragged offsets) with the reference's math, so a wrong conversion, view or
offset shows up as a wrong output against the float64 reference. What the fakes cannot check is
the peers' own numerics and API acceptance: the GPU self-test
(``python -m pagedattn.bench.selftest``) does that.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from pagedattn.adapters import flashinfer as flashinfer_adapter
from pagedattn.adapters.common import NotApplicable
from pagedattn.adapters.flashinfer import paged_csr, split_decodes, sub_query_start_loc
from pagedattn.bench.check import compare, reference
from pagedattn.bench.providers import PROVIDERS
from pagedattn.bench.workloads import Case, build_inputs
from pagedattn.reference import attention_ref, mla_decode_ref

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_size=32)


def _case(segments, shape=SMALL, block_size=16, **features) -> Case:
    params = dict(shape, block_size=block_size, segments=[list(s) for s in segments],
                  sliding_window=features.get("sliding_window"), softcap=features.get("softcap"),
                  sinks=bool(features.get("sinks", False)))
    return Case(name=str(segments), workload="test", kind="mixed", params=params)


# ---------------------------------------------------------------------------------------------
# conversions


@pytest.mark.parametrize("lens,block_size", [
    pytest.param([1, 16, 17, 45], 16, id="edges"),
    pytest.param([200, 3, 64], 16, id="mixed"),
    pytest.param([5, 9], 1, id="page1"),
])
def test_paged_csr_lists_each_sequences_pages(lens, block_size):
    g = torch.Generator().manual_seed(0)
    pages = [-(-n // block_size) for n in lens]
    table = torch.randint(0, 1000, (len(lens), max(pages) + 2), generator=g, dtype=torch.int32)
    csr = paged_csr(table, torch.tensor(lens, dtype=torch.int32), block_size)
    assert csr.indptr.tolist() == [0] + torch.tensor(pages).cumsum(0).tolist()
    for s, n in enumerate(lens):
        got = csr.indices[csr.indptr[s]:csr.indptr[s + 1]]
        assert got.tolist() == table[s, :pages[s]].tolist()
        assert 1 <= csr.last_page_len[s] <= block_size
        assert (pages[s] - 1) * block_size + int(csr.last_page_len[s]) == n
    assert csr.indptr.dtype == csr.indices.dtype == csr.last_page_len.dtype == torch.int32


def test_paged_csr_rejects_what_it_cannot_express():
    table = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(NotApplicable, match="no keys"):
        paged_csr(table, torch.tensor([3, 0], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="columns"):
        paged_csr(table, torch.tensor([3, 40], dtype=torch.int32), 16)


@pytest.mark.parametrize("q_lens,reorder", [
    pytest.param([1, 1, 1], False, id="decodes"),
    pytest.param([32, 1, 1], False, id="prefill-then-decodes"),
    pytest.param([1, 1, 5, 7], False, id="decodes-then-rest"),
    pytest.param([1, 9, 1], True, id="interleaved"),
    pytest.param([4, 1, 6, 1], True, id="alternating"),
])
def test_split_decodes_orders_decodes_first(q_lens, reorder):
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    split = split_decodes(qsl)
    assert split.decode == [s for s, n in enumerate(q_lens) if n == 1]
    assert split.rest == [s for s, n in enumerate(q_lens) if n != 1]
    assert split.reorder is reorder
    assert sorted(split.token_order) == list(range(qsl[-1]))
    expect = [t for s in split.order for t in range(qsl[s], qsl[s + 1])]
    assert split.token_order == expect
    assert sub_query_start_loc(qsl, split.rest)[-1] == sum(q_lens[s] for s in split.rest)


def test_window_left_counts_the_keys_before_the_query():
    assert flashinfer_adapter.window_left(None) == -1
    assert flashinfer_adapter.window_left(1) == 0  # only the query's own key
    assert flashinfer_adapter.window_left(128) == 127


# ---------------------------------------------------------------------------------------------
# gating


def test_registry_and_gates_on_the_cpu():
    for name in ("flashinfer", "flashinfer-prefill", "cudnn-paged"):
        ok, why = PROVIDERS[name].available()
        assert ok is False and why  # no GPU here: unavailable, with the reason
    fi, cu = PROVIDERS["flashinfer"], PROVIDERS["cudnn-paged"]
    assert fi.supports(_case([(2, 1, 64)]))[0]
    ok, why = fi.supports(_case([(2, 1, 64)], sinks=True))
    assert not ok and "sinks" in why
    ok, why = cu.supports(_case([(2, 1, 64)], sliding_window=16))
    assert not ok and "sliding_window" in why
    assert cu.supports(_case([(1, 32, 32), (3, 1, 33)]))[0]


# ---------------------------------------------------------------------------------------------
# fakes


def _attend(q, k_cache, v_cache, pages, kv_len, *, scale, causal, window=None, softcap=None):
    """Reference attention of one sequence's queries (the last ``len(q)`` positions)."""
    hk, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache[pages.long()].reshape(-1, hk, d)[:kv_len]
    v = v_cache[pages.long()].reshape(-1, hk, v_cache.shape[3])[:kv_len]
    q_pos = torch.arange(q.shape[0]) + (kv_len - q.shape[0])
    out, _ = attention_ref(q, k, v, q_pos=q_pos, scale=scale, causal=causal, sliding_window=window,
                           softcap=softcap)
    return out


class _FakePaged:
    """BatchDecode/BatchPrefill wrappers as FlashInfer documents them, computed by the reference."""

    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False, backend="auto"):
        assert kv_layout == "NHD"
        self._backend = "fake"

    def _store(self, indptr, indices, last_page_len, page_size, sm_scale, window_left, logits_soft_cap):
        self.indptr, self.indices, self.last = indptr.tolist(), indices.cpu(), last_page_len.tolist()
        self.page_size, self.scale = page_size, sm_scale
        self.window = window_left + 1 if window_left >= 0 else None
        self.softcap = logits_soft_cap

    def _seq(self, s):
        pages = self.indices[self.indptr[s]:self.indptr[s + 1]]
        return pages, (len(pages) - 1) * self.page_size + self.last[s]

    def _run_rows(self, q, kv, out, qo_indptr, causal):
        assert isinstance(kv, tuple) and out is not None and out.shape == q.shape
        assert q.shape[0] == qo_indptr[-1]
        for s in range(len(self.last)):
            a, b = qo_indptr[s], qo_indptr[s + 1]
            pages, kv_len = self._seq(s)
            out[a:b] = _attend(q[a:b], *kv, pages, kv_len, scale=self.scale, causal=causal,
                               window=self.window, softcap=self.softcap).to(out.dtype)
        return out


class FakeDecode(_FakePaged):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", q_data_type, kv_data_type, sm_scale, window_left, logits_soft_cap):
        self._store(indptr, indices, last_page_len, page_size, sm_scale, window_left, logits_soft_cap)

    def run(self, q, kv, out=None):
        return self._run_rows(q, kv, out, list(range(len(self.last) + 1)), causal=True)


class FakePrefill(_FakePaged):
    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             causal, pos_encoding_mode="NONE", q_data_type, kv_data_type, sm_scale, window_left, logits_soft_cap):
        self._store(indptr, indices, last_page_len, page_size, sm_scale, window_left, logits_soft_cap)
        self.qo_indptr, self.causal = qo_indptr.tolist(), causal

    def run(self, q, kv, out=None):
        return self._run_rows(q, kv, out, self.qo_indptr, causal=self.causal)


class FakeMLA:
    def __init__(self, workspace, backend="auto"):
        self._backend = "fake"

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, query_layout, kv_cache_layout):
        assert query_layout == kv_cache_layout == "split"
        self.m, self.page_size, self.causal, self.scale = metadata, page_size, causal, sm_scale
        self.widths = (head_dim_ckv, head_dim_kpe)

    def run(self, *, query, kv_cache, out):
        (q_nope, q_pe), (ckv, kpe) = query, kv_cache
        assert (ckv.shape[-1], kpe.shape[-1]) == self.widths == (q_nope.shape[-1], q_pe.shape[-1])
        qo, kv_ptr, lens = self.m.qo_indptr.tolist(), self.m.kv_indptr.tolist(), self.m.kv_len_arr.tolist()
        for s in range(len(lens)):
            pages = self.m.kv_indices[kv_ptr[s]:kv_ptr[s + 1]].long()
            c = ckv[pages].reshape(-1, ckv.shape[-1])[:lens[s]].double()
            r = kpe[pages].reshape(-1, kpe.shape[-1])[:lens[s]].double()
            a, b = qo[s], qo[s + 1]
            scores = (torch.einsum("qhd,kd->qhk", q_nope[a:b].double(), c)
                      + torch.einsum("qhd,kd->qhk", q_pe[a:b].double(), r)) * self.scale
            if self.causal:
                q_pos = torch.arange(b - a) + lens[s] - (b - a)
                scores = scores.masked_fill(torch.arange(lens[s])[None, None, :] > q_pos[:, None, None], -math.inf)
            out[a:b] = torch.einsum("qhk,kd->qhd", scores.softmax(-1), c).to(out.dtype)
        return out


class FakeMLA06(FakeMLA):
    """FlashInfer up to 0.6's MLA wrapper (vLLM 0.26 ships 0.6.14): no MLAPlanMetadata, the
    indptrs and the four tensors as arguments."""

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        metadata = types.SimpleNamespace(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                                         kv_len_arr=kv_len_arr)
        super().plan(metadata=metadata, num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                     page_size=page_size, causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
                     kv_data_type=kv_data_type, query_layout="split", kv_cache_layout="split")

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None):
        return super().run(query=(q_nope, q_pe), kv_cache=(ckv_cache, kpe_cache), out=out)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    from pagedattn.adapters import flashinfer as adapter

    fi = types.ModuleType("flashinfer")
    fi.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    fi.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = FakeMLA
    mla.MLAPlanMetadata = types.SimpleNamespace(
        csr=lambda qo_indptr, kv_indptr, kv_indices, kv_len_arr: types.SimpleNamespace(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr))
    fi.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(adapter, "WORKSPACE_BYTES", 16)
    monkeypatch.setattr(adapter, "_WORKSPACES", {})
    return adapter


BATCHES = [
    pytest.param([(3, 1, 75)], {}, id="decode"),
    pytest.param([(1, 40, 40)], {}, id="prefill"),
    pytest.param([(2, 16, 80)], {}, id="extend"),
    pytest.param([(1, 32, 32), (3, 1, 33)], {}, id="mixed"),
    pytest.param([(2, 1, 64), (1, 24, 24), (1, 8, 72), (1, 1, 17)], {}, id="mixed-interleaved"),
    pytest.param([(1, 1, 50), (1, 20, 20)], dict(sliding_window=8, softcap=30.0), id="window-softcap"),
]


def _check(prepared, inputs):
    ref = reference(inputs)
    err, ok, tol = compare(prepared.to_tokens(prepared()), ref)
    assert ok, (err, tol, prepared.note)


@pytest.mark.parametrize("mode", ["engine", "prefill"])
@pytest.mark.parametrize("segments,features", BATCHES)
def test_flashinfer_adapter_feeds_the_wrappers_the_batch(fake_flashinfer, segments, features, mode):
    inputs = build_inputs(_case(segments, **features), torch.device("cpu"), torch.float16, seed=1)
    prepared = PROVIDERS["flashinfer" if mode == "engine" else "flashinfer-prefill"].prepare(inputs)
    _check(prepared, inputs)
    q_lens = inputs.case.query_lens
    if mode == "engine" and 1 in q_lens and any(n > 1 for n in q_lens):
        assert "decodes" in prepared.note and "prefill/extend" in prepared.note


def test_flashinfer_adapter_refuses_fp32(fake_flashinfer):
    inputs = build_inputs(_case([(2, 1, 64)]), torch.device("cpu"), torch.float32)
    with pytest.raises(NotApplicable, match="fp16/bf16"):
        PROVIDERS["flashinfer"].prepare(inputs)


@pytest.mark.parametrize("segments,features", BATCHES)
def test_flashinfer_backend_runs_the_wrappers(fake_flashinfer, segments, features):
    """The ``flashinfer`` attention backend on the same adapter: planned once, two layers."""
    from pagedattn.backends import BackendConfig, get_backend

    backend = get_backend("flashinfer")
    inputs = build_inputs(_case(segments, **features), torch.device("cpu"), torch.float16, seed=6)
    md = backend.plan(inputs.block_table, inputs.seq_lens, inputs.query_start_loc,
                      BackendConfig.for_call(inputs.q, inputs.k_cache, **inputs.features))
    ref = reference(inputs)
    for _ in range(2):  # the second layer reuses the planned wrappers
        out = torch.full_like(inputs.q, float("nan"))
        backend.forward(inputs.q, inputs.k_cache, inputs.v_cache, md, out=out, **inputs.features)
        err, ok, tol = compare(out, ref)
        assert ok, (err, tol)
    assert len(md.state.wrappers) == 1
    with pytest.raises(ValueError, match="sinks"):
        backend.forward(inputs.q, inputs.k_cache, inputs.v_cache, md, sinks=torch.zeros(inputs.q.shape[1]))


def latent_batch(seq_lens, query_len, *, heads, block_size, latent, rope, seed):
    """An fp16 MLA batch on a paged latent cache with shuffled block ids: (q, kv, table, lens,
    qsl, out poisoned with NaN)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    kv = torch.randn(sum(pages) + 2, block_size, latent + rope, generator=g).half()
    perm = torch.randperm(kv.shape[0], generator=g).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    start = 0
    for s, n in enumerate(pages):
        table[s, :n] = perm[start:start + n]
        start += n
    q = torch.randn(len(seq_lens) * query_len, heads, latent + rope, generator=g).half()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32) * query_len
    out = torch.full((q.shape[0], heads, latent), float("nan"), dtype=q.dtype)
    return q, kv, table, lens, qsl, out


@pytest.mark.parametrize("api", ["0.7", "0.6"])
@pytest.mark.parametrize("seq_lens,query_len", [([70, 5, 33], 1), ([40, 19], 3)])
def test_flashinfer_mla_adapter_splits_the_latent_cache(fake_flashinfer, monkeypatch, seq_lens, query_len, api):
    """Both MLA APIs: 0.7's plan metadata and split layouts by name, and up to 0.6's arguments."""
    if api == "0.6":
        mla = sys.modules["flashinfer.mla"]
        monkeypatch.delattr(mla, "MLAPlanMetadata")
        monkeypatch.setattr(mla, "BatchMLAPagedAttentionWrapper", FakeMLA06)
    heads, latent = 4, 64
    q, kv, table, lens, qsl, out = latent_batch(seq_lens, query_len, heads=heads, block_size=16, latent=latent,
                                                rope=16, seed=2)
    run, note = fake_flashinfer.mla_call(q, kv, table, lens, qsl, scale=0.1, latent_dim=latent, out=out)
    run()
    ref, _ = mla_decode_ref(q[..., :latent], q[..., latent:], kv, table, lens, qsl, scale=0.1)
    err = float((out.double() - ref).abs().max())
    assert err <= 1e-2, (err, note)


class _FakeTensor:
    def __init__(self, dim=None, stride=None, uid=None, **_):
        self.dim, self.stride, self.uid, self.ragged = dim, stride, uid, None

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def set_uid(self, uid):
        self.uid = uid
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_output(self, _):
        return self

    def set_data_type(self, _):
        return self


class _FakeGraph:
    """Declarations recorded; execute reads every buffer through its declared dims and strides
    (as the backend reads only pointers), page tables, lengths and ragged element offsets."""

    def __init__(self, **_):
        self.tensors = []

    def tensor(self, name="", dim=None, stride=None, data_type=None, uid=None):
        t = _FakeTensor(list(dim), list(stride), uid)
        self.tensors.append(t)
        return t

    def sdpa(self, *, name, q, k, v, **params):
        self.q, self.k, self.v, self.params = q, k, v, params
        self.o = _FakeTensor()
        return self.o, None

    def build(self, heuristics):
        pass

    def get_workspace_size(self):
        return 0

    @staticmethod
    def _read(buf, dim, stride, offset=0):
        return torch.as_strided(buf, dim, stride, buf.storage_offset() + offset)

    def execute(self, pack, workspace, handle=None):
        p = self.params
        assert p["use_padding_mask"] and p["generate_stats"] is False
        lens_q = pack[p["seq_len_q"].uid].flatten().tolist()
        lens_kv = pack[p["seq_len_kv"].uid].flatten().tolist()
        table = pack[p["paged_attention_k_table"].uid]
        assert pack[p["paged_attention_v_table"].uid] is table
        k_all = self._read(pack[self.k.uid], self.k.dim, self.k.stride)  # [blocks, heads, block_size, d]
        v_all = self._read(pack[self.v.uid], self.v.dim, self.v.stride)
        bs = self.k.dim[2]
        for b, (sq, skv) in enumerate(zip(lens_q, lens_kv)):
            assert skv <= p["paged_attention_max_seq_len_kv"]
            q_off = int(pack[self.q.ragged.uid].flatten()[b]) if self.q.ragged else b * self.q.stride[0]
            o_off = int(pack[self.o.ragged.uid].flatten()[b]) if self.o.ragged else b * self.o.stride[0]
            hq, d = self.q.dim[1], self.q.dim[3]
            q = self._read(pack[self.q.uid], [hq, sq, d], self.q.stride[1:], q_off).transpose(0, 1)
            pages = table[b, 0, : -(-skv // bs), 0].long()
            k = k_all[pages].transpose(1, 2).reshape(-1, k_all.shape[1], d)[:skv]
            v = v_all[pages].transpose(1, 2).reshape(-1, v_all.shape[1], d)[:skv]
            q_pos = torch.arange(sq) + skv - sq  # bottom-right alignment
            out, _ = attention_ref(q, k, v, q_pos=q_pos, scale=p["attn_scale"],
                                   causal=bool(p.get("use_causal_mask_bottom_right")))
            self._read(pack[self.o.uid], [hq, sq, d], self.o.stride[1:], o_off).copy_(out.transpose(0, 1))


@pytest.fixture
def fake_cudnn(monkeypatch):
    from pagedattn.adapters import cudnn as adapter

    cu = types.ModuleType("cudnn")
    cu.data_type = types.SimpleNamespace(HALF="half", BFLOAT16="bf16", FLOAT="float", INT32="int32")
    cu.heur_mode = types.SimpleNamespace(A="a", FALLBACK="fallback")
    cu.pygraph = _FakeGraph
    cu.create_handle = lambda: object()
    cu.set_stream = lambda handle, stream: None
    monkeypatch.setitem(sys.modules, "cudnn", cu)
    monkeypatch.setattr(adapter, "_GRAPHS", {})
    monkeypatch.setattr(adapter, "_HANDLES", {})
    monkeypatch.setattr(adapter.torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(adapter.torch.cuda, "device", lambda device: _Null())
    return adapter


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("segments,features", [b for b in BATCHES if b.id != "window-softcap"])
def test_cudnn_adapter_declares_the_paged_layout(fake_cudnn, segments, features):
    inputs = build_inputs(_case(segments, **features), torch.device("cpu"), torch.float16, seed=3)
    prepared = PROVIDERS["cudnn-paged"].prepare(inputs)
    _check(prepared, inputs)
    ragged = len(set(inputs.case.query_lens)) > 1
    assert ("ragged" in prepared.note) is ragged


def test_cudnn_graphs_are_shared_by_batches_of_one_shape(fake_cudnn):
    case = _case([(1, 32, 32), (3, 1, 33)])
    for seed in (4, 5):
        inputs = build_inputs(case, torch.device("cpu"), torch.float16, seed=seed)
        _check(PROVIDERS["cudnn-paged"].prepare(inputs), inputs)
    assert len(fake_cudnn._GRAPHS) == 1


def test_cudnn_adapter_refuses_unwired_features(fake_cudnn):
    inputs = build_inputs(_case([(2, 1, 64)], softcap=30.0), torch.device("cpu"), torch.float16)
    with pytest.raises(NotApplicable, match="softcap"):
        PROVIDERS["cudnn-paged"].prepare(inputs)


# ---------------------------------------------------------------------------------------------
# the suite's own runners with the peers (fakes standing in for them)


def test_bench_cli_runs_the_peers(fake_flashinfer, fake_cudnn, monkeypatch, tmp_path):
    import json

    from pagedattn.bench.cli import main

    monkeypatch.setattr(fake_flashinfer, "availability", lambda: (True, ""))
    monkeypatch.setattr(fake_cudnn, "availability", lambda: (True, ""))
    out = tmp_path / "peers.json"
    rc = main(["--quick", "--workload", "decode,mixed,gptoss", "--provider", "flashinfer,flashinfer-prefill,cudnn-paged",
               "--case", "B=2 L=64", "--case", "mixed", "--no-ceilings", "--json", str(out),
               "--markdown", str(tmp_path / "t.md")])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    by = {(r["case"], r["provider"]): r for r in records}
    for provider in ("flashinfer", "flashinfer-prefill", "cudnn-paged"):
        for case in ("decode B=2 L=64", "mixed 1x32+3x1@33"):
            assert by[case, provider]["status"] == "ok", by[case, provider]
    gptoss = by["gptoss decode B=2 L=64", "flashinfer"]
    assert gptoss["status"] == "skip" and "sinks" in gptoss["reason"]


def test_bench_mla_runs_flashinfer(fake_flashinfer, monkeypatch, tmp_path):
    import json

    from pagedattn.bench.mla import main

    monkeypatch.setattr(fake_flashinfer, "availability", lambda: (True, ""))
    out = tmp_path / "mla.json"
    assert main(["--quick", "--batch", "1", "--seq-len", "64", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    peer = [r for r in records if r["provider"] == "flashinfer"]
    assert len(peer) == 1 and peer[0]["ok"] and peer[0]["max_err_vs_torch"] <= 3e-2


# ---------------------------------------------------------------------------------------------
# vLLM's compiled kernels (FA3, FlashMLA): gates, conversions, and the adapter against fakes


def test_vllm_fa3_is_listed_and_unavailable_here():
    from pagedattn.adapters import vllm_kernels

    prov = PROVIDERS["vllm-fa3"]
    assert prov.anchor and prov.by_default and "FlashAttention-3" in prov.description
    ok, why = prov.available()
    assert ok is False and ("vllm" in why.lower() or "GPU" in why or "sm90" in why), why
    ok, why = vllm_kernels.flashmla_availability()
    assert ok is False and ("vllm" in why.lower() or "GPU" in why or "sm90" in why), why


@pytest.mark.parametrize("capability,expect", [((8, 0), "sm80"), ((10, 0), "sm100"), ((9, 0), "vllm")])
def test_vllm_gates_check_hopper_before_importing_vllm(monkeypatch, capability, expect):
    """With a GPU, the sm90 check comes first (importing vLLM changes inductor settings in this
    process); on sm90 the next reason names vLLM (not installed here, or its extension)."""
    from pagedattn.adapters import vllm_kernels

    monkeypatch.setattr(vllm_kernels, "gpu_status", lambda: (True, ""))
    monkeypatch.setattr(vllm_kernels.torch.cuda, "get_device_capability", lambda *a: capability)
    asked = []

    def module_status(name):  # stands in for the import, which a machine with vLLM would make
        asked.append(name)
        return False, f"{name} is not installed"

    monkeypatch.setattr(vllm_kernels, "module_status", module_status)
    for availability in (vllm_kernels.fa3_availability, vllm_kernels.flashmla_availability):
        ok, why = availability()
        assert ok is False and expect in why.lower(), why
    assert asked == ([] if "vllm" not in expect else ["vllm", "vllm"])


def test_fa_window_keeps_the_keys_left_of_the_query():
    from pagedattn.adapters.vllm_kernels import fa_window

    assert fa_window(None) == (-1, -1) and fa_window(0) == (-1, -1)
    assert fa_window(1) == (0, 0)  # only the query's own key
    assert fa_window(128) == (127, 0)  # vLLM's decoder mapping: (sliding_window - 1, 0)
    assert fa_window(128, causal=False) == (127, 127)  # and its non-causal one
    with pytest.raises(ValueError):
        fa_window(-4)


def test_vllm_fa3_declines_what_it_cannot_run():
    prov = PROVIDERS["vllm-fa3"]
    assert prov.supports(_case([(1, 32, 32), (3, 1, 33)]))[0]
    assert prov.supports(_case([(2, 1, 64)], sliding_window=16, softcap=30.0, sinks=True))[0]
    ok, why = prov.supports(_case([(2, 1, 64)], block_size=8))
    assert not ok and "multiples of 16" in why
    ok, why = prov.supports(_case([(2, 1, 64)], shape=dict(SMALL, head_size=36)))
    assert not ok and "head size" in why
    ok, why = prov.supports(_case([(2, 1, 64)], shape=dict(SMALL, head_size=320)))
    assert not ok and "head size" in why
    ok, why = prov.supports(_case([(2, 1, 64)], shape=dict(SMALL, num_q_heads=96, num_kv_heads=8), sinks=True))
    assert not ok and "64 query heads" in why


def test_flashmla_supports_64_token_pages_and_one_query_length():
    from pagedattn.adapters.vllm_kernels import flashmla_supports

    common = dict(dtype=torch.bfloat16, row_dim=576, latent_dim=512)
    assert flashmla_supports(block_size=64, query_lens=[2, 2, 2], **common)[0]
    ok, why = flashmla_supports(block_size=16, **common)
    assert not ok and "64-token pages" in why
    ok, why = flashmla_supports(block_size=64, query_lens=[1, 2], **common)
    assert not ok and "one query length" in why
    ok, why = flashmla_supports(block_size=64, dtype=torch.float32, row_dim=576, latent_dim=512)
    assert not ok and "fp16/bf16" in why


def _paged_reference(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table, *, scale,
                     causal, window_left, softcap, sinks):
    """What a FlashAttention-style paged call writes into ``out``: each sequence's queries over
    its pages (``window_left`` keys before the query stay visible, -1: all), by the reference;
    checks the host maxima the call was given."""
    qsl, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    assert max(b - a for a, b in zip(qsl[:-1], qsl[1:])) <= max_seqlen_q and max(lens) <= max_seqlen_k
    bs = k.shape[1]
    for s, kv_len in enumerate(lens):
        a, b = qsl[s], qsl[s + 1]
        pages = block_table[s, : -(-kv_len // bs)].long()
        ks = k[pages].reshape(-1, k.shape[2], k.shape[3])[:kv_len]
        vs = v[pages].reshape(-1, v.shape[2], v.shape[3])[:kv_len]
        res, _ = attention_ref(q[a:b], ks, vs, q_pos=torch.arange(b - a) + kv_len - (b - a), scale=scale,
                               causal=causal, sliding_window=window_left + 1 if window_left >= 0 else None,
                               softcap=softcap or None, sinks=sinks)
        out[a:b] = res.to(out.dtype)


class _FakeFA3:
    """``vllm.vllm_flash_attn`` as vLLM 0.26 defines it (the keywords of flash_attn_interface.py),
    computed by the reference from the page table, lengths, window and s_aux it is handed."""

    def __init__(self):
        self.calls = 0

    def get_scheduler_metadata(self, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                               cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                               cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                               causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0, pack_gqa=None,
                               sm_margin=0):
        return types.SimpleNamespace(batch_size=batch_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                     page_size=page_size, causal=causal, window_size=tuple(window_size),
                                     has_softcap=has_softcap, qkv_dtype=qkv_dtype)

    def flash_attn_varlen_func(self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                               seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
                               return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
                               scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None,
                               num_splits=0, output_scale=None, fa_version=2, s_aux=None, cp_world_size=1,
                               cp_rank=0, cp_tot_seqused_k=None, mask_mod=None, aux_tensors=None, dynamic_causal=None):
        assert fa_version == 3 and cu_seqlens_k is None and out is not None and out.shape == q.shape
        assert cu_seqlens_q.dtype == seqused_k.dtype == block_table.dtype == torch.int32
        assert k.shape[1] % 16 == 0 and k.dim() == 4  # (num_pages, page_size, num_heads_k, head_size)
        left, right = window_size
        assert right == (0 if causal and left >= 0 else (left if left >= 0 else -1))
        m = scheduler_metadata
        assert m.causal == causal and m.window_size == (left, right) and m.page_size == k.shape[1]
        assert m.has_softcap == (softcap > 0) and (m.max_seqlen_q, m.max_seqlen_k) == (max_seqlen_q, max_seqlen_k)
        if s_aux is not None:
            assert s_aux.dtype == torch.bfloat16 and s_aux.shape == (q.shape[1],)
        _paged_reference(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
                         scale=softmax_scale, causal=causal, window_left=left, softcap=softcap,
                         sinks=None if s_aux is None else s_aux.float())
        self.calls += 1
        return out


class _FakeTritonUnified:
    """``unified_attention`` as vLLM 0.26 defines it (triton_unified_attention.py, its keywords up
    to the ones TRITON_ATTN passes), with its checks on the segment buffers, computed by the
    reference from the page table, lengths, window and sinks it is handed."""

    def __init__(self):
        self.calls = 0
        self.used_3d = []

    def unified_attention(self, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                          causal, window_size, block_table, softcap, q_descale, k_descale, v_descale,
                          seq_threshold_3D=None, num_par_softmax_segments=None, softmax_segm_output=None,
                          softmax_segm_max=None, softmax_segm_expsum=None, alibi_slopes=None, output_scale=None,
                          qq_bias=None, sinks=None, mm_prefix_range=None, rswa_prefix_lens=None, rswa_window=None,
                          use_alibi_sqrt=False):
        num_seqs, num_kv_heads, hq = seqused_k.shape[0], k.shape[2], q.shape[1]
        assert out is not None and out.shape == q.shape and q_descale is None
        assert k_descale.shape == v_descale.shape == (num_seqs, num_kv_heads) and bool((k_descale == 1).all())
        assert seq_threshold_3D == 128 // num_kv_heads and num_par_softmax_segments == 16
        pad = 1 << (q.shape[2] - 1).bit_length()
        assert softmax_segm_output.shape == (seq_threshold_3D, hq, 16, pad)
        assert softmax_segm_max.shape == softmax_segm_expsum.shape == (seq_threshold_3D, hq, 16)
        left, right = window_size
        assert right == (0 if causal and left >= 0 else (left if left >= 0 else -1))
        if sinks is not None:
            assert sinks.dtype == torch.float32 and sinks.shape == (hq,)
        self.used_3d.append(max_seqlen_q == 1 and num_seqs <= seq_threshold_3D)
        _paged_reference(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
                         scale=softmax_scale, causal=causal, window_left=left, softcap=softcap, sinks=sinks)
        self.calls += 1


class _FakeSchedMeta:
    def __init__(self):
        self.have_initialized = False


class _FakeFlashMLA:
    """vLLM 0.26's copy of FlashMLA's wrappers (flash_mla_interface.py) with dense_decode.h's
    checks on q, the cache and ``out``, computed by the reference."""

    def __init__(self):
        self.calls = 0

    def get_mla_metadata(self, *args, **kwargs):
        return _FakeSchedMeta(), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None, out=None):
        assert isinstance(tile_scheduler_metadata, _FakeSchedMeta) and num_splits is None and not is_fp8_kvcache
        batch, s_q, h_q, d = q.shape
        assert k_cache.shape[1] == 64 and k_cache.shape[2] == 1 and k_cache.shape[3] == d == 576
        assert block_table.dtype == cache_seqlens.dtype == torch.int32 and head_dim_v == 512
        assert out.shape == (batch, 1, s_q * h_q, head_dim_v) and out.is_contiguous()  # dense_decode.h's check
        tile_scheduler_metadata.have_initialized = True
        rows = out.view(batch, s_q, h_q, head_dim_v)
        for b, kv_len in enumerate(cache_seqlens.tolist()):
            pages = block_table[b, : -(-kv_len // 64)].long()
            keys = k_cache[pages].reshape(-1, d)[:kv_len].double()
            scores = torch.einsum("qhd,kd->qhk", q[b].double(), keys) * softmax_scale
            if causal and s_q > 1:
                q_pos = torch.arange(s_q) + kv_len - s_q
                scores = scores.masked_fill(torch.arange(kv_len)[None, None, :] > q_pos[:, None, None], -math.inf)
            rows[b] = torch.einsum("qhk,kd->qhd", scores.softmax(-1), keys[:, :head_dim_v]).to(out.dtype)
        self.calls += 1
        return out, None


@pytest.fixture
def fake_vllm(monkeypatch):
    from pagedattn.adapters import vllm_kernels

    fa3, mla, triton_unified = _FakeFA3(), _FakeFlashMLA(), _FakeTritonUnified()
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.26.0+fake"
    fa_mod = types.ModuleType(vllm_kernels.FA3_MODULE)
    fa_mod.get_scheduler_metadata = fa3.get_scheduler_metadata
    fa_mod.flash_attn_varlen_func = fa3.flash_attn_varlen_func
    mla_mod = types.ModuleType(vllm_kernels.FLASHMLA_MODULE)
    mla_mod.get_mla_metadata = mla.get_mla_metadata
    mla_mod.flash_mla_with_kvcache = mla.flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, vllm_kernels.FA3_MODULE, fa_mod)
    monkeypatch.setitem(sys.modules, vllm_kernels.FLASHMLA_MODULE, mla_mod)
    triton_mod = types.ModuleType(vllm_kernels.TRITON_UNIFIED_MODULE)
    triton_mod.unified_attention = triton_unified.unified_attention
    monkeypatch.setitem(sys.modules, vllm_kernels.TRITON_UNIFIED_MODULE, triton_mod)
    return types.SimpleNamespace(adapter=vllm_kernels, fa3=fa3, mla=mla, triton=triton_unified)


@pytest.mark.parametrize("segments,features", BATCHES + [
    pytest.param([(2, 1, 64), (1, 16, 48)], dict(sliding_window=32, sinks=True), id="window-sinks"),
])
def test_vllm_fa3_adapter_feeds_flash_attn_the_batch(fake_vllm, segments, features):
    inputs = build_inputs(_case(segments, **features), torch.device("cpu"), torch.float16, seed=7)
    prepared = PROVIDERS["vllm-fa3"].prepare(inputs)
    assert fake_vllm.fa3.calls == 0  # prepare makes no attention call
    _check(prepared, inputs)
    assert fake_vllm.fa3.calls == 1 and "AOT scheduler metadata" in prepared.note
    assert ("sinks" in prepared.note) is ("sinks" in features)


def test_vllm_fa3_adapter_refuses_fp32(fake_vllm):
    inputs = build_inputs(_case([(2, 1, 64)]), torch.device("cpu"), torch.float32)
    with pytest.raises(NotApplicable, match="fp16/bf16"):
        PROVIDERS["vllm-fa3"].prepare(inputs)


@pytest.mark.parametrize("segments,features", BATCHES + [
    pytest.param([(2, 1, 64), (1, 16, 48)], dict(sliding_window=32, sinks=True, softcap=20.0), id="window-sinks-softcap"),
])
def test_vllm_triton_adapter_feeds_unified_attention_the_batch(fake_vllm, segments, features):
    inputs = build_inputs(_case(segments, **features), torch.device("cpu"), torch.float16, seed=5)
    prepared = PROVIDERS["vllm-triton"].prepare(inputs)
    assert fake_vllm.triton.calls == 0  # prepare makes no attention call
    _check(prepared, inputs)
    decode = inputs.max_query_len == 1
    assert fake_vllm.triton.calls == 1 and fake_vllm.triton.used_3d == [decode]
    assert ("3D kernel" in prepared.note) is decode
    w = features.get("sliding_window")
    assert (f"window ({w - 1}, 0)" in prepared.note) if w else "window" not in prepared.note


def test_vllm_triton_is_listed_unavailable_here_and_refuses_fp32(fake_vllm):
    prov = PROVIDERS["vllm-triton"]
    assert prov.anchor and "Triton" in prov.description
    ok, why = prov.available()
    assert ok is False and ("GPU" in why or "TRITON_INTERPRET" in why), why
    inputs = build_inputs(_case([(2, 1, 64)]), torch.device("cpu"), torch.float32)
    with pytest.raises(NotApplicable, match="fp16/bf16"):
        prov.prepare(inputs)


@pytest.mark.parametrize("seq_lens,query_len", [([130, 5, 64], 1), ([70, 19], 3)])
def test_flashmla_adapter_views_the_latent_cache(fake_vllm, seq_lens, query_len):
    heads, latent, rope = 4, 512, 64
    q, kv, table, lens, qsl, out = latent_batch(seq_lens, query_len, heads=heads, block_size=64, latent=latent,
                                                rope=rope, seed=3)
    run, note = fake_vllm.adapter.flashmla_call(q, kv, table, lens, qsl, scale=0.05, latent_dim=latent, out=out)
    assert fake_vllm.mla.calls == 1  # the scheduling call, made before any timing
    out.fill_(float("nan"))
    assert run() is out
    ref, _ = mla_decode_ref(q[..., :latent], q[..., latent:], kv, table, lens, qsl, scale=0.05)
    err = float((out.double() - ref).abs().max())
    assert err <= 1e-2, (err, note)
    with pytest.raises(NotApplicable, match="64-token pages"):
        fake_vllm.adapter.flashmla_call(q, kv[:, :16].contiguous(), table, lens, qsl, scale=0.05, latent_dim=latent,
                                        out=out)


def test_bench_mla_runs_flashmla(fake_vllm, monkeypatch, tmp_path, capsys):
    import json

    from pagedattn.bench.mla import main

    monkeypatch.setattr(fake_vllm.adapter, "flashmla_availability", lambda: (True, ""))
    out = tmp_path / "mla.json"
    argv = ["--quick", "--batch", "1", "--seq-len", "70", "--json", str(out)]
    assert main(argv + ["--block-size", "64"]) == 0
    records = json.loads(out.read_text())["records"]
    peer = [r for r in records if r["provider"] == "flashmla"]
    assert len(peer) == 1 and peer[0]["ok"] and peer[0]["max_err_vs_torch"] <= 3e-2
    capsys.readouterr()
    assert main(argv) == 0  # page 16: listed as skipped, with the page size FlashMLA reads
    assert not [r for r in json.loads(out.read_text())["records"] if r["provider"] == "flashmla"]
    assert "--block-size 64" in capsys.readouterr().err
    assert main(argv + ["--block-size", "64", "--no-peers"]) == 0
    assert not [r for r in json.loads(out.read_text())["records"] if r["provider"] == "flashmla"]
    assert "flashmla" not in capsys.readouterr().err
