"""``python -m hicache``: the ``hicache`` command line."""

from __future__ import annotations

import sys

from hicache.cli.main import main

sys.exit(main())
