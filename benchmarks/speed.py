"""Speed benchmark (same as `safe-engine bench`): JSON with tokens/s, peak memory and ratios vs floors.

python benchmarks/speed.py --lengths 64 256 512 --out benchmarks/results/speed.json
"""

import sys

from safe_engine.bench import main

if __name__ == "__main__":
    sys.exit(main())
