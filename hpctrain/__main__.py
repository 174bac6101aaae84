"""``python -m hpctrain ...``: the same as the ``hpctrain`` command."""

import sys

from .cli import main

sys.exit(main())
