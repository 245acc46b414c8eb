"""The ``pagedattn`` command: ``pagedattn check``, ``pagedattn bench`` and ``pagedattn generate``."""

from __future__ import annotations

import sys

USAGE = """usage: pagedattn <command> [options]

commands:
  check     run every path and feature against the reference on this machine
  bench     time the reference workloads (see `pagedattn bench --help`);
            `pagedattn bench e2e`: the engine end to end (see `pagedattn bench e2e --help`)
  generate  generate text with the engine (see `pagedattn generate --help`)
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
    if command == "bench" and rest and rest[0] == "e2e":
        from pagedattn.bench.e2e import main as e2e_main

        return e2e_main(rest[1:])
    if command == "bench":
        from pagedattn.bench.cli import main as bench_main

        return bench_main(rest)
    if command == "generate":
        from pagedattn.engine.cli import main as generate_main

        return generate_main(rest)
    print(f"pagedattn: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
