"""`python -m qft.simulate`: see qft/simulate/cli.py."""

import sys

from qft.simulate.cli import main

sys.exit(main())
