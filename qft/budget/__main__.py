"""`python -m qft.budget`: the command line lives in qft/budget/cli.py."""

import sys

from qft.budget.cli import main

sys.exit(main())
