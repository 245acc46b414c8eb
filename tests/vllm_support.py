"""What tests/test_vllm.py and tests/test_vllm_mla.py share: the skip where vLLM is not installed,
the paged layout of a batch of requests, and the check that a stand-in config has only attributes
vLLM's config classes have."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedattn.testing import fill_block_table, query_start_loc_of


def require_vllm() -> None:
    """Skip the calling test module where vLLM is not installed (the default environment: vLLM
    pins another torch and triton); a vLLM that is installed but fails to import fails."""
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise
        pytest.skip("vLLM is not installed (.ci/run runs this file with vllm==0.26.0 and with vllm==0.33.0)",
                    allow_module_level=True)


def paged_layout(cases, block_size: int, num_blocks: int, g: torch.Generator):
    """Requests ``(query_len, seq_len)`` on distinct random pages of a cache of ``num_blocks``:
    ``(block_table, query_start_loc, slots)``. Table entries past a request's pages are random
    ids (never read); ``slots`` holds each new token's cache slot, in batch order."""
    pages = [-(-kv // block_size) for _, kv in cases]
    assert sum(pages) <= num_blocks
    physical = torch.randperm(num_blocks, generator=g)
    block_table = fill_block_table(
        torch.randint(0, num_blocks, (len(cases), max(pages + [1])), generator=g, dtype=torch.int32), pages, physical)
    slots = [int(block_table[s, p // block_size]) * block_size + p % block_size
             for s, (q, kv) in enumerate(cases) for p in range(kv - q, kv)]
    return block_table, query_start_loc_of(cases), slots


def assert_stand_in_matches(stand_in, parts: dict) -> None:
    """Every attribute of ``stand_in`` is a field or attribute of vLLM's ``VllmConfig``, and every
    attribute of each ``parts`` object (``{config class: stand-in object}``) one of its class."""
    from vllm.config import VllmConfig

    def names(cls):
        return {f.name for f in dataclasses.fields(cls)} | set(dir(cls))

    for attr in vars(stand_in):
        assert attr in names(VllmConfig), attr
    for cls, obj in parts.items():
        for attr in vars(obj):
            assert attr in names(cls), f"{cls.__name__}.{attr}"


def _plain(member):
    return member.__func__ if isinstance(member, (staticmethod, classmethod)) else member


def override_mismatches(cls) -> list[str]:
    """Where a method ``cls`` defines over one of its vLLM base classes could not take a call made
    the base's way: a named argument of the base's that ours does not accept (vLLM passes some
    by keyword, e.g. 0.26's ``run_prefill_context_chunk(chunk_idx=...)``), or an argument of
    ours without a default that the base does not have. Methods taking ``**kwargs`` accept any
    name; positional-only and ``*args`` parameters are not compared, nor the arguments with
    defaults of a base's ``__init__`` (vLLM makes a builder or impl with the required ones; the
    others are for a subclass to pass up, e.g. ``MLACommonMetadataBuilder``'s ``metadata_cls``)."""
    import inspect

    problems = []
    for name, member in vars(cls).items():
        ours = _plain(member)
        if not callable(ours) or (name.startswith("__") and name != "__init__"):
            continue
        base = next((b for b in cls.__mro__[1:] if name in vars(b) and b is not object), None)
        if base is None or not (base.__module__ or "").startswith("vllm"):
            continue
        try:
            mine, theirs = inspect.signature(ours).parameters, inspect.signature(_plain(vars(base)[name])).parameters
        except (TypeError, ValueError):
            continue
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in mine.values()):
            for p in theirs.values():
                hook = name == "__init__" and p.default is not inspect.Parameter.empty
                if p.kind in named and p.name not in ("self", "cls") and p.name not in mine and not hook:
                    problems.append(f"{cls.__name__}.{name} does not take {base.__name__}'s argument {p.name!r}")
        for p in mine.values():
            if (p.kind in named and p.name not in ("self", "cls") and p.default is inspect.Parameter.empty
                    and p.name not in theirs):
                problems.append(f"{cls.__name__}.{name} needs {p.name!r}, which {base.__name__}.{name} does not have")
    return problems
