"""`python -m safe_engine.server -m SPEC -m SPEC ...`: the same as `safe-engine serve ...`."""

import sys

from ..cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
