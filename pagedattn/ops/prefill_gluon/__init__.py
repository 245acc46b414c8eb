"""Causal paged prefill in Gluon for Hopper (sm90): producer warps gather pages with cp.async, two consumer warpgroups run wgmma; taken for large prefills on sm90 (launch.use_gluon_prefill)."""
