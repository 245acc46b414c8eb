"""Benchmark suite: workloads, providers (pagedattn and anchors), timing, ceilings, reports.

``python -m pagedattn.bench --help``; plots: ``python -m pagedattn.bench.plot results.json``.
Nothing here imports a Triton kernel at import time.
"""


def main(argv=None) -> int:
    """Entry point for ``pagedattn bench ...`` (see :func:`pagedattn.bench.cli.main`)."""
    from pagedattn.bench.cli import main as _main

    return _main(argv)
