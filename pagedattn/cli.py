"""The ``pagedattn`` command: ``pagedattn check`` and ``pagedattn bench``."""

from __future__ import annotations

import sys

USAGE = """usage: pagedattn <command> [options]

commands:
  check   run every path and feature against the reference on this machine
  bench   time the reference workloads (see `pagedattn bench --help`)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "check":
        from pagedattn.check import main as check_main

        return check_main(rest)
    if command == "bench":
        from pagedattn.bench.cli import main as bench_main

        return bench_main(rest)
    print(f"pagedattn: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
