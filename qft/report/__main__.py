"""`python -m qft.report`: the command line lives in qft/report/cli.py."""

import sys

from qft.report.cli import main

sys.exit(main())
