"""``python -m tokenloom.cli``: the command line (torchrun users run ``-m tokenloom.cli build``)."""

import sys

from tokenloom.cli import main

sys.exit(main())
