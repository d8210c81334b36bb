"""``python -m bench [--quick]``: the benchmarks with targets and verdicts (bench/measure.py)."""

import sys

from bench.measure import main

sys.exit(main())
