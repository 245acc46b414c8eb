import sys

from pagedattn.cli import main

sys.exit(main())
