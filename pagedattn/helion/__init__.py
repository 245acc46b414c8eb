"""pagedattn's paged attention written in Helion (an optional extra: ``pip install -e ".[helion]"`` from the checkout).

``import pagedattn`` never imports this package or Helion. See docs/helion.md.

>>> import pagedattn.helion as ph
>>> plan = ph.plan_attention(qsl_host, lens_host, num_q_heads=32, num_kv_heads=8, head_size=128)
>>> out = ph.paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, plan=plan)
"""

import importlib


def _torch_compat() -> None:
    """Helion 1.5.1's autotuner logger imports ``IntelGPUError`` from torch's inductor, which
    torch 2.11 does not define (2.13 does): an exception class stands in for it there (Helion
    only uses it to classify errors of Intel GPUs)."""
    try:
        from torch._inductor.runtime import triton_compat
    except ImportError:  # pragma: no cover
        return
    if not hasattr(triton_compat, "IntelGPUError"):
        triton_compat.IntelGPUError = type("IntelGPUError", (RuntimeError,), {})


_torch_compat()
try:
    importlib.import_module("helion")
except ImportError as e:  # pragma: no cover - exercised where helion is absent
    # ModuleNotFoundError (an ImportError): what pytest.importorskip and callers that probe for
    # optional packages take for "not installed"
    raise ModuleNotFoundError(
        "pagedattn.helion needs Helion (from the pagedattn checkout: pip install -e '.[helion]', "
        "or pip install helion==1.5.1)", name="helion"
    ) from e

from pagedattn.helion.api import UNSUPPORTED, paged_attention
from pagedattn.helion.plan import HelionPlan, plan_attention

__all__ = ["paged_attention", "plan_attention", "HelionPlan", "UNSUPPORTED"]
