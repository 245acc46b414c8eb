"""Causal paged prefill in Gluon for Hopper (sm90): opt-in (PAGEDATTN_PREFILL_GLUON=1), correct on the H200, not yet faster than the tl kernel."""
