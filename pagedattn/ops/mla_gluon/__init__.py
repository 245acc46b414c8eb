"""MLA decode in Gluon for Hopper (sm90), taken there when the heads fill 64-row CTAs (launch.use_gluon_mla)."""
