"""MLA decode in Gluon for Hopper (sm90): 64 heads a CTA on two warpgroups; taken on sm90 when the heads fill whole CTAs (launch.use_gluon_mla)."""
