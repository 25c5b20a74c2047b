"""``python -m theory`` runs the ``kvq-theory`` command line."""

import sys

from .cli import main

sys.exit(main())
