"""``python -m codebooks`` runs the ``kvq-codebooks`` command line."""

import sys

from .cli import main

sys.exit(main())
