"""Safety of the metadata: validate_metadata names bad entries (by default on CPU tensors);
without it, bad block ids, lengths and slots never make a kernel touch memory outside the cache
(poisoned guard blocks around the cache are never read into an output and never written)."""

import pytest
import torch

from pagedattn import paged_attention, plan_attention, validate_metadata, write_kv
from pagedattn.reference import paged_attention_ref
from pagedattn.testing import TOLERANCES, make_paged_batch
from tests.conftest import DEVICE

GUARD = 3  # poisoned blocks on each side of the cache


def guarded(batch):
    """Rebuild the caches as the middle of a larger buffer whose outer blocks hold NaN."""
    out = []
    for cache in (batch.k_cache, batch.v_cache):
        buf = torch.full((cache.shape[0] + 2 * GUARD, *cache.shape[1:]), float("nan"), dtype=cache.dtype,
                         device=cache.device)
        buf[GUARD:-GUARD] = cache
        out.append(buf)
    batch.k_cache, batch.v_cache = out[0][GUARD:-GUARD], out[1][GUARD:-GUARD]
    return out


def guards_intact(buffers):
    return all(torch.isnan(b[:GUARD].float()).all() and torch.isnan(b[-GUARD:].float()).all() for b in buffers)


def run_paths(batch, paths=(("unified", None), ("split_kv", 4)), **kwargs):
    """(out, lse) of each (path, splits): by default the unified path and the split-KV path with 4 splits."""
    results = []
    for path, splits in paths:
        # the prefill plan's grid follows the batch's query lengths; the decode paths' plans only need sizes
        qsl, lens = ((batch.query_start_loc, batch.seq_lens) if path == "prefill"
                     else ([0] + [0] * len(batch.cases), [1] * len(batch.cases)))
        plan = plan_attention(qsl, lens, num_q_heads=batch.q.shape[1], num_kv_heads=batch.k_cache.shape[2],
                              head_size=batch.q.shape[2], device=DEVICE, path=path, num_splits=splits,
                              max_num_tokens=batch.q.shape[0])
        out = torch.full_like(batch.q, float("nan"))
        results.append(paged_attention(*batch.args(), out=out, return_lse=True, plan=plan, **kwargs))
    return results


CORRUPTIONS = {
    "block-id-too-large": lambda b, n: b.block_table.__setitem__((1, 0), n),
    "block-id-past-guard": lambda b, n: b.block_table.__setitem__((1, 1), n + GUARD + 5),
    "block-id-negative": lambda b, n: b.block_table.__setitem__((2, 0), -1),
    "seq-len-past-table": lambda b, n: b.seq_lens.__setitem__(1, b.block_table.shape[1] * 16 + 40),
}


def check_corruption(corruption, cases, paths=(("unified", None), ("split_kv", 4))):
    """The corruption is reported by validate=True; without it, every path keeps the guards
    unread and unwritten, writes no NaN, and leaves sequences 0 and 3 exact."""
    g = torch.Generator().manual_seed(len(corruption))
    batch = make_paged_batch(cases, dtype=torch.float32, device=DEVICE, generator=g)
    buffers = guarded(batch)
    ref_out, ref_lse = paged_attention_ref(*batch.args())  # before the corruption
    CORRUPTIONS[corruption](batch, batch.k_cache.shape[0])
    with pytest.raises(ValueError, match="sequence"):
        paged_attention(*batch.args(), validate=True)
    for out, lse in run_paths(batch, paths, validate=False):
        assert not torch.isnan(out).any(), "a guard block or an unwritten row reached the output"
        # the sequences the corruption did not touch are exact
        for s in (0, 3):
            rows = slice(int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1]))
            torch.testing.assert_close(out[rows].double(), ref_out[rows], atol=2e-4, rtol=2e-4)
    assert guards_intact(buffers)


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_metadata_is_masked_and_reported(corruption):
    check_corruption(corruption, [(1, 70), (3, 40), (2, 35), (1, 17)])


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_metadata_prefill_path(corruption, monkeypatch):
    """The large-tile kernel checks a chunk's block ids at once: a chunk with an id outside the
    cache runs the checked tile loop, the clean chunks of the same program the unchecked one.
    Small chunks (96 keys at 16-token pages) give each program several; the interpreter reads
    the module's constants at every call."""
    from pagedattn.ops.prefill import kernel

    monkeypatch.setattr(kernel, "CHUNK_TARGET_KEYS", 128)
    check_corruption(corruption, [(40, 300), (40, 260), (35, 200), (17, 17)], paths=(("prefill", None),))


def test_corrupt_query_start_loc_is_masked():
    g = torch.Generator().manual_seed(9)
    batch = make_paged_batch([(1, 70), (3, 40)], dtype=torch.float32, device=DEVICE, generator=g)
    buffers = guarded(batch)
    batch.query_start_loc[2] = 50  # past num_tokens = 4
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(*batch.args(), validate=True)
    for out, _ in run_paths(batch, validate=False):
        assert not torch.isnan(out[:1]).any()
    assert guards_intact(buffers)


def test_write_kv_out_of_range_slots_are_skipped():
    g = torch.Generator().manual_seed(2)
    k_buf = torch.full((8 + 2 * GUARD, 16, 2, 32), float("nan"), device=DEVICE)
    v_buf = k_buf.clone()
    k_cache, v_cache = k_buf[GUARD:-GUARD], v_buf[GUARD:-GUARD]
    k_cache.zero_()
    v_cache.zero_()
    key = torch.randn(5, 2, 32, generator=g).to(DEVICE)
    slots = torch.tensor([3, -1, 8 * 16, 8 * 16 + 40, -7], device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\]"):
        write_kv(key, key, k_cache, v_cache, slots, validate=True)
    write_kv(key, key, k_cache, v_cache, slots, validate=False)
    torch.testing.assert_close(k_cache[0, 3], key[0])
    assert guards_intact([k_buf, v_buf])
    assert int((k_cache != 0).sum()) == int((key[0] != 0).sum())


CPU_DEFAULT = [
    pytest.param(lambda b: b.query_start_loc.__setitem__(2, 50), r"query_start_loc\[-1\]|decreases", id="qsl-past-q"),
    pytest.param(lambda b: b.query_start_loc.__setitem__(1, 5), "decreases at index 2", id="qsl-not-monotonic"),
    pytest.param(lambda b: b.block_table.__setitem__((1, 0), b.k_cache.shape[0]), r"block_table\[1, 0\]",
                 id="block-id-out-of-range"),
    pytest.param(lambda b: b.seq_lens.__setitem__(0, 0), "shorter than its", id="seq-len-below-queries"),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="the default validates CPU tensors only")
@pytest.mark.parametrize("change, message", CPU_DEFAULT)
def test_cpu_calls_validate_the_metadata_by_default(change, message):
    """On CPU tensors (the interpreter) paged_attention checks the metadata's contents without
    being asked, and validate=False turns it off (the kernels then mask the bad entries)."""
    batch = make_paged_batch([(1, 70), (3, 40)], dtype=torch.float32, device=DEVICE,
                             generator=torch.Generator().manual_seed(4))
    change(batch)
    with pytest.raises(ValueError, match=message):
        paged_attention(*batch.args())
    paged_attention(*batch.args(), max_query_len=3, max_seq_len=70, validate=False)


@pytest.mark.skipif(DEVICE != "cpu", reason="the default validates CPU tensors only")
def test_cpu_default_lets_sequences_share_blocks():
    """Prefix caching shares blocks: the default check allows it, validate=True names it."""
    batch = make_paged_batch([(1, 20), (1, 20)], dtype=torch.float32, device=DEVICE,
                             generator=torch.Generator().manual_seed(5))
    batch.block_table[1, 0] = batch.block_table[0, 0]
    paged_attention(*batch.args())
    with pytest.raises(ValueError, match="allow_shared_blocks"):
        paged_attention(*batch.args(), validate=True)


@pytest.mark.skipif(DEVICE != "cpu", reason="the default validates CPU tensors only")
def test_cpu_write_kv_validates_slots_by_default():
    cache = torch.zeros(4, 16, 2, 32)
    key = torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]"):
        write_kv(key, key, cache, cache.clone(), torch.tensor([3, 64]))


def test_validation_default_follows_the_device(monkeypatch):
    from pagedattn.validate import validation_requested

    monkeypatch.delenv("PAGEDATTN_VALIDATE", raising=False)
    assert validation_requested(None, torch.device("cpu"))
    assert not validation_requested(None, torch.device("cuda", 0))  # a GPU call would synchronize
    assert not validation_requested(False, torch.device("cpu"))
    assert validation_requested(True, torch.device("cuda", 0))
    monkeypatch.setenv("PAGEDATTN_VALIDATE", "1")
    assert validation_requested(None, torch.device("cuda", 0)) and validation_requested(False, torch.device("cpu"))


@pytest.mark.parametrize(
    "change, message",
    [
        pytest.param(lambda b: b.query_start_loc.__setitem__(0, 1), r"query_start_loc\[0\]", id="qsl-start"),
        pytest.param(lambda b: b.query_start_loc.__setitem__(2, 0), "decreases at index 2", id="qsl-decreasing"),
        pytest.param(lambda b: b.query_start_loc.__setitem__(3, 7), r"query_start_loc\[-1\]", id="qsl-end"),
        pytest.param(lambda b: b.seq_lens.__setitem__(1, -4), r"sequence 1: seq_lens\[1\] = -4", id="negative-len"),
        pytest.param(lambda b: b.seq_lens.__setitem__(1, 2), "sequence 1.*shorter", id="len-below-queries"),
        pytest.param(lambda b: b.block_table.__setitem__((2, 1), 10**6), r"sequence 2: block_table\[2, 1\]", id="id-range"),
        pytest.param(lambda b: b.block_table.__setitem__((2, 0), int(b.block_table[0, 0])), "used by sequence 0", id="shared"),
        pytest.param(lambda b: b.seq_lens.__setitem__(0, 10**5), "sequence 0.*columns", id="past-table"),
    ],
)
def test_validate_metadata_names_the_entry(change, message):
    g = torch.Generator().manual_seed(4)
    batch = make_paged_batch([(1, 70), (3, 40), (2, 35)], dtype=torch.float16, device=DEVICE, generator=g)
    validate_metadata(batch.block_table, batch.seq_lens, batch.query_start_loc, num_tokens=batch.q.shape[0],
                      num_blocks=batch.k_cache.shape[0], block_size=16)  # clean metadata passes
    change(batch)
    with pytest.raises(ValueError, match=message):
        validate_metadata(batch.block_table, batch.seq_lens, batch.query_start_loc, num_tokens=batch.q.shape[0],
                          num_blocks=batch.k_cache.shape[0], block_size=16)


def test_shared_blocks_allowed_when_asked(monkeypatch):
    g = torch.Generator().manual_seed(5)
    batch = make_paged_batch([(1, 40), (1, 40)], dtype=torch.float32, device=DEVICE, generator=g)
    batch.block_table[1, 0] = batch.block_table[0, 0]  # a shared prefix page
    with pytest.raises(ValueError, match="allow_shared_blocks"):
        paged_attention(*batch.args(), validate=True)
    out = paged_attention(*batch.args(), validate=True, allow_shared_blocks=True)
    ref, _ = paged_attention_ref(*batch.args())
    torch.testing.assert_close(out.double(), ref, atol=TOLERANCES[torch.float32][0], rtol=TOLERANCES[torch.float32][1])
    monkeypatch.setenv("PAGEDATTN_VALIDATE", "1")
    with pytest.raises(ValueError, match="allow_shared_blocks"):
        paged_attention(*batch.args())
