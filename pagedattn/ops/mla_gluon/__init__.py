"""MLA decode in Gluon for Hopper (sm90): opt-in with PAGEDATTN_MLA_GLUON=1, compiled but not yet run on a GPU."""
