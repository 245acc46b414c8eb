"""The backend interface: capability queries, ``validate``, ``plan`` and ``forward``.

A backend computes :func:`pagedattn.paged_attention` semantics (docs/contract.md) for one engine step.
The engine describes what its layers use once, as a :class:`BackendConfig`; a backend's
:meth:`AttentionBackend.validate` answers with the reasons it cannot serve that configuration
(an empty list: it can). Per step the engine calls :meth:`AttentionBackend.plan` with the
batch's metadata, then :meth:`AttentionBackend.forward` per layer with the metadata it got.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

__all__ = [
    "FEATURES",
    "BackendConfig",
    "BatchMetadata",
    "AttentionBackend",
    "features_of_call",
]

# Every feature name a configuration may list (the keyword features of paged_attention).
FEATURES = frozenset(
    {
        "causal",  # causal=True
        "noncausal",  # causal=False: encoders, cross attention
        "window",  # sliding_window
        "softcap",
        "alibi",  # alibi_slopes, linear
        "alibi_sqrt",  # alibi_slopes with alibi_sqrt=True
        "sinks",
        "prefix",  # prefix_ranges
        "fp8",  # float8_e4m3fn cache with k_scale / v_scale
        "lse",  # return_lse
    }
)


def features_of_call(
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    alibi_slopes=None,
    alibi_sqrt: bool = False,
    sinks=None,
    prefix_ranges=None,
    return_lse: bool = False,
    k_cache: torch.Tensor | None = None,
    **_ignored,
) -> frozenset[str]:
    """The feature names that a ``paged_attention`` call with these keywords uses."""
    used = {"causal" if causal else "noncausal"}
    if sliding_window:
        used.add("window")
    if softcap:
        used.add("softcap")
    if alibi_slopes is not None:
        used.add("alibi_sqrt" if alibi_sqrt else "alibi")
    if sinks is not None:
        used.add("sinks")
    if prefix_ranges is not None:
        used.add("prefix")
    if return_lse:
        used.add("lse")
    if k_cache is not None and k_cache.dtype == torch.float8_e4m3fn:
        used.add("fp8")
    return frozenset(used)


@dataclass(frozen=True)
class BackendConfig:
    """What a model's attention layers need; a backend's ``validate`` judges it.

    Parameters
    ----------
    device : the device of q and the cache (``"cuda"``, ``"cpu"``, ``torch.device``).
    dtype : q's dtype (float16, bfloat16 or float32); with the ``"fp8"`` feature the cache is
        float8_e4m3fn, otherwise also ``dtype``.
    head_size, num_q_heads, num_kv_heads : the attention shape.
    features : names from :data:`FEATURES` the layers use (``"causal"`` when empty).

    Examples
    --------
    >>> BackendConfig("cuda", torch.bfloat16, 128, 32, 8, features={"causal", "window"})
    """

    device: Any = "cpu"
    dtype: torch.dtype = torch.float16
    head_size: int = 128
    num_q_heads: int = 32
    num_kv_heads: int = 8
    features: frozenset = field(default_factory=lambda: frozenset({"causal"}))

    def __post_init__(self):
        feats = frozenset(self.features) or frozenset({"causal"})
        unknown = sorted(feats - FEATURES)
        if unknown:
            raise ValueError(f"features: unknown feature names {unknown}; known: {sorted(FEATURES)}")
        object.__setattr__(self, "features", feats)
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if "fp8" in self.features else self.dtype

    @classmethod
    def for_call(cls, q: torch.Tensor, k_cache: torch.Tensor, **features) -> "BackendConfig":
        """The configuration of one ``paged_attention(q, k_cache, ..., **features)`` call."""
        return cls(
            device=q.device,
            dtype=q.dtype,
            head_size=q.shape[-1],
            num_q_heads=q.shape[1],
            num_kv_heads=k_cache.shape[2],
            features=features_of_call(k_cache=k_cache, **features),
        )


@dataclass
class BatchMetadata:
    """One engine step's batch (the tensors of docs/contract.md) plus host copies, as ``plan`` returns it.

    ``block_table`` ``[num_seqs, max_blocks_per_seq]`` int32, ``seq_lens`` ``[num_seqs]`` int32 and
    ``query_start_loc`` ``[num_seqs + 1]`` int32 live on the kernels' device; ``query_start_loc_host``
    and ``seq_lens_host`` are the same numbers as Python lists (the backends that loop over
    sequences read these, so their per-layer calls do not synchronize). ``state`` is what the
    backend's planner made (an :class:`pagedattn.AttentionPlan` for ``triton``; None for the
    others). ``backend`` names the backend that planned it.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_host: list
    seq_lens_host: list
    max_query_len: int
    max_seq_len: int
    backend: str = ""
    state: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1] if self.query_start_loc_host else 0

    @property
    def query_lens_host(self) -> list:
        qsl = self.query_start_loc_host
        return [b - a for a, b in zip(qsl[:-1], qsl[1:])]

    @classmethod
    def from_tensors(cls, block_table, seq_lens, query_start_loc, *, backend: str = "") -> "BatchMetadata":
        """Metadata from the device tensors (one host synchronization for the host copies)."""
        qsl = [int(v) for v in query_start_loc.tolist()]
        lens = [int(v) for v in seq_lens.tolist()]
        if len(qsl) != len(lens) + 1:
            raise ValueError(
                f"query_start_loc has {len(qsl)} entries; expected len(seq_lens) + 1 = {len(lens) + 1}"
            )
        q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        return cls(
            block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc,
            query_start_loc_host=qsl, seq_lens_host=lens,
            max_query_len=max(q_lens + [0]), max_seq_len=max(lens + [0]), backend=backend,
        )


class AttentionBackend(abc.ABC):
    """One way to compute paged attention.

    Subclasses set ``name``, ``dtypes`` and ``feature_names`` and implement :meth:`forward`;
    the defaults of the capability queries and of :meth:`validate` read those, and
    :meth:`unavailable_reason` / :meth:`device_reason` add what depends on the environment.
    """

    name: ClassVar[str] = ""
    dtypes: ClassVar[tuple] = (torch.float16, torch.bfloat16, torch.float32)
    feature_names: ClassVar[frozenset] = FEATURES
    min_head_size: ClassVar[int] = 1
    max_head_size: ClassVar[int] = 1 << 30

    # --- capability queries ---------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all here (a missing package), or None."""
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def device_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on ``device`` with ``dtype``, or None."""
        return None

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in self.dtypes

    def supports_feature(self, name: str) -> bool:
        if name not in FEATURES:
            raise ValueError(f"unknown feature {name!r}; known: {sorted(FEATURES)}")
        return name in self.feature_names

    def supports_head_size(self, head_size: int) -> bool:
        return self.min_head_size <= head_size <= self.max_head_size

    def validate(self, config: BackendConfig) -> list[str]:
        """Reasons this backend cannot serve ``config``; empty when it can."""
        reasons = []
        missing = self.unavailable_reason()
        if missing:
            return [missing]
        if not self.supports_dtype(config.dtype):
            reasons.append(f"dtype {str(config.dtype).replace('torch.', '')} is not supported")
        if not self.supports_head_size(config.head_size):
            reasons.append(f"head_size {config.head_size} is not supported")
        if config.num_kv_heads < 1 or config.num_q_heads % config.num_kv_heads:
            reasons.append(
                f"num_q_heads {config.num_q_heads} is not a multiple of num_kv_heads {config.num_kv_heads}"
            )
        for feat in sorted(config.features):
            if not self.supports_feature(feat):
                reasons.append(f"feature {feat!r} is not supported")
        dev = self.device_reason(config.device, config.dtype)
        if dev:
            reasons.append(dev)
        return reasons

    # --- plan / run -----------------------------------------------------------------------
    def plan(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        config: BackendConfig,
        **options,
    ) -> BatchMetadata:
        """Plan one engine step (host work, at most one synchronization); the default keeps host copies."""
        md = BatchMetadata.from_tensors(block_table, seq_lens, query_start_loc, backend=self.name)
        md.state = self._plan_state(md, config, **options)
        return md

    def _plan_state(self, md: BatchMetadata, config: BackendConfig, **options):
        if options:
            raise TypeError(f"backend {self.name!r} takes no plan options, got {sorted(options)}")
        return None

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: BatchMetadata,
        **features,
    ):
        """Attention of the planned batch: ``out`` or ``(out, lse)`` when ``return_lse=True``.

        ``features`` are ``paged_attention``'s keywords (``scale``, ``causal``, ``sliding_window``,
        ``softcap``, ``alibi_slopes``, ``alibi_sqrt``, ``sinks``, ``prefix_ranges``, ``k_scale``,
        ``v_scale``, ``out``, ``return_lse``).
        """

    def _check_metadata(self, metadata: BatchMetadata) -> None:
        if not isinstance(metadata, BatchMetadata):
            raise TypeError(f"metadata must be a BatchMetadata from {self.name}.plan(), got {type(metadata).__name__}")
        if metadata.backend != self.name:
            raise ValueError(f"metadata was planned by backend {metadata.backend!r}, not {self.name!r}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
