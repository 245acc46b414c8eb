"""Host-side planning: which path runs a batch, with which tiles, and the workspaces it needs.

An engine builds one :class:`AttentionPlan` per step with :func:`plan_attention` (from host
metadata; it may synchronize once if given device tensors) and passes it to every layer's
``paged_attention(..., plan=plan)``, which then allocates nothing and never synchronizes. A call
without a plan gets one from :func:`plan_for_call`, by the same rule from the batch's maxima.

One module per concern:

* ``rule.py``: the path rule (path, split count, fixed segments) for both, and its constants
* ``tiles.py``: the Q-block kernels' tiles, fitted to the target; ``prefill.py``: the prefill
  kernel's tiles
* ``worklist.py``: the persistent kernel's work lists, grid constants and schedules
* ``workspace.py``: the split partials, the work-list buffers and their pinned staging
* ``attention_plan.py``: :class:`AttentionPlan`, its one constructor and ``update``
* ``planner.py``: :func:`plan_attention`, :func:`plan_for_graphs` and :func:`plan_for_call`
* ``mla.py``: the MLA decode's config and split choice

This package re-exports the names other modules use. A test that replaces a function must
patch the module that calls it (``pagedattn.plan.prefill.pick_prefill_tiles``), not this one.
"""

from pagedattn.ops.common.tiles import Tiles
from pagedattn.plan.attention_plan import AttentionPlan, PlanSizes, host_list
from pagedattn.plan.mla import (
    MLA_FILL_PER_SM,
    MLA_MAX_SPLITS,
    MLA_MIN_SEGMENT_TOKENS,
    choose_mla_splits,
    mla_programs_per_sm,
    pick_mla_config,
    resolve_mla_config,
)
from pagedattn.plan.planner import (
    CALL_PLANS_KEPT,
    GRAPH_WORKSPACE_BYTES,
    plan_attention,
    plan_for_call,
    plan_for_graphs,
)
from pagedattn.plan.prefill import SHORT_PREFILL_WAVES, pick_prefill_tiles, short_prefill
from pagedattn.plan.rule import (
    FILL_MAX_SPLITS,
    FULL_WAVE_FILL,
    INVARIANT_SEGMENT_TOKENS,
    LONG_DECODE_TOKENS,
    LONG_SEGMENT_TOKENS,
    MANY_WAVES_SEGMENT_TOKENS,
    MAX_SPLITS,
    MIN_SEGMENT_TOKENS,
    PATHS,
    PERSISTENT_UNCAPPED_PROGRAMS_PER_SM,
    PREFILL_MIN_QUERY_LEN,
    RESIDENT_PROGRAMS_PER_SM,
    SHORT_SEGMENT_TOKENS,
    SPLIT_COST_TOKENS,
    SPLIT_KV_MAX_QUERY_LEN,
    UNEQUAL_RATIO,
    auto_path,
    balanced_segment,
    choose_num_splits,
    choose_path,
    min_segment_tokens,
    persistent_takes_fewer_waves,
)
from pagedattn.plan.tiles import fitted, num_sms, pick_tiles
from pagedattn.plan.worklist import (
    ATOMIC_MIN_ITEMS_PER_PROGRAM,
    PERSISTENT_MAX_REGISTERS,
    PERSISTENT_MAX_SPLITS,
    PERSISTENT_PROGRAMS_PER_SM,
    SCHEDULES,
    UNEQUAL_MAX_REGISTERS,
    UNEQUAL_WAVES,
    persistent_work_list,
    work_list_layout,
)

__all__ = [
    "ATOMIC_MIN_ITEMS_PER_PROGRAM", "CALL_PLANS_KEPT", "FILL_MAX_SPLITS", "FULL_WAVE_FILL", "GRAPH_WORKSPACE_BYTES",
    "INVARIANT_SEGMENT_TOKENS",
    "LONG_DECODE_TOKENS", "LONG_SEGMENT_TOKENS", "MANY_WAVES_SEGMENT_TOKENS", "MAX_SPLITS", "MIN_SEGMENT_TOKENS",
    "MLA_FILL_PER_SM", "MLA_MAX_SPLITS", "MLA_MIN_SEGMENT_TOKENS", "PATHS", "PERSISTENT_MAX_SPLITS",
    "PERSISTENT_MAX_REGISTERS", "PERSISTENT_PROGRAMS_PER_SM", "PERSISTENT_UNCAPPED_PROGRAMS_PER_SM", "PREFILL_MIN_QUERY_LEN",
    "RESIDENT_PROGRAMS_PER_SM", "SCHEDULES", "SHORT_PREFILL_WAVES", "SHORT_SEGMENT_TOKENS", "SPLIT_COST_TOKENS",
    "SPLIT_KV_MAX_QUERY_LEN",
    "UNEQUAL_MAX_REGISTERS", "UNEQUAL_RATIO", "UNEQUAL_WAVES",
    "AttentionPlan", "PlanSizes", "Tiles",
    "auto_path", "balanced_segment", "choose_mla_splits", "choose_num_splits", "choose_path", "fitted", "host_list",
    "min_segment_tokens", "mla_programs_per_sm", "num_sms", "persistent_takes_fewer_waves", "persistent_work_list",
    "pick_mla_config",
    "pick_prefill_tiles", "pick_tiles", "plan_attention", "plan_for_call", "plan_for_graphs", "resolve_mla_config",
    "short_prefill",
    "work_list_layout",
]
