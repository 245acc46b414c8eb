"""Causal paged prefill in Gluon for Hopper (sm90), taken there for large prefills (launch.use_gluon_prefill)."""
