"""pagedattn's paged attention written in Helion (an optional extra: ``pip install pagedattn[helion]``).

``import pagedattn`` never imports this package or Helion. See docs/helion.md.

>>> import pagedattn.helion as ph
>>> plan = ph.plan_attention(qsl_host, lens_host, num_q_heads=32, num_kv_heads=8, head_size=128)
>>> out = ph.paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, plan=plan)
"""

try:
    import helion as _helion  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised where helion is absent
    raise ImportError(
        "pagedattn.helion needs Helion (pip install 'pagedattn[helion]', or helion==1.5.1)"
    ) from e

from pagedattn.helion.api import UNSUPPORTED, paged_attention
from pagedattn.helion.plan import HelionPlan, plan_attention

__all__ = ["paged_attention", "plan_attention", "HelionPlan", "UNSUPPORTED"]
