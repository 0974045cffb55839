"""`python -m tkopt ...`: the `tkopt` command, for when the virtual environment's bin/ is not on PATH."""

import sys

from tkopt.cli import main

sys.exit(main())
