"""`python -m safe_engine ...`: the same as `safe-engine ...` (e.g. `python -m safe_engine serve -m SPEC`)."""

import sys

from .cli import main

sys.exit(main())
