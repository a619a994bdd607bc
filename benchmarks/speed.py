"""Speed benchmark (same as `safe-engine bench`): JSON with tokens/s, peak memory and ratios vs floors.

python benchmarks/speed.py --threads 1 -m qwen2.5-coder-0.5b -m smollm2-135m --out benchmarks/results/speed_pair.json
(one run per member set; the README's Speed section has the exact commands behind benchmarks/results/speed.md)
"""

import sys

from safe_engine.bench import main

if __name__ == "__main__":
    sys.exit(main())
