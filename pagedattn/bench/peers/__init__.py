"""Peer implementations for the benchmark: FlashInfer's paged wrappers and cuDNN's paged SDPA graph.

Each adapter reads pagedattn's own paged tensors (no copy of the cache) and calls the peer the
way an engine does: metadata converted and planned once per batch, outside the timed call; the
timed call binds the layer's tensors and launches. The providers that use them are registered
in :mod:`pagedattn.bench.providers`; ``python -m pagedattn.bench.providers --selftest`` runs
every adapter once on small cases against the float64 reference.

Nothing here imports ``flashinfer`` or ``cudnn`` at import time.
"""
