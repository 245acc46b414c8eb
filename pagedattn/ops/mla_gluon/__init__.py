"""MLA decode in Gluon for Hopper (sm90): opt-in with PAGEDATTN_MLA_GLUON=1, correct on the H200, not yet timed."""
