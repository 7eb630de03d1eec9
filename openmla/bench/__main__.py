"""``python -m openmla.bench``: ``openmla bench`` without the top-level CLI."""

import sys

from openmla.bench import main

sys.exit(main())
