"""``python -m paramstore``: see :mod:`paramstore.cli`."""

import sys

from paramstore.cli import main

sys.exit(main())
