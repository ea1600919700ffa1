"""``python -m ort_trainer`` runs the ``ort-trainer`` command line."""

import sys

from .cli import main

sys.exit(main())
