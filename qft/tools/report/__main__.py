"""`python -m qft.tools.report`: the command line lives in qft/tools/report/cli.py."""

import sys

from qft.tools.report.cli import main

sys.exit(main())
