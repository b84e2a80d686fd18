"""`python -m qft.tools.simulate`: see qft/tools/simulate/cli.py."""

import sys

from qft.tools.simulate.cli import main

sys.exit(main())
