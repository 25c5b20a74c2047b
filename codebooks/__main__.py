"""``python -m codebooks`` runs the ``kvq-codebooks`` command line."""

import sys

from .cli import main

if __name__ == "__main__":  # importing the module (as the API docs' build does) runs nothing
    sys.exit(main())
