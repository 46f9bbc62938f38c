"""``python -m tests.history``: the randomized history check's long mode (explore.py)."""

import sys

from tests.history.explore import main

sys.exit(main())
