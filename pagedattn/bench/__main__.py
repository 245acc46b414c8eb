"""``python -m pagedattn.bench``: see :mod:`pagedattn.bench.cli`."""

import sys

from pagedattn.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
