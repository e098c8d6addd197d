"""``python -m tokenloom``: the command line (same as ``tokenloom`` and ``python -m tokenloom.cli``)."""

import sys

from tokenloom.cli import main

sys.exit(main())
