"""``python -m openmla ...``: the command line (see :mod:`openmla.cli`)."""

import sys

from openmla.cli import main

sys.exit(main())
