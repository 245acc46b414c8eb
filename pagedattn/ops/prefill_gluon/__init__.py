"""Causal paged prefill in Gluon for Hopper (sm90): opt-in (PAGEDATTN_PREFILL_GLUON=1), compiled, not yet run on a GPU."""
