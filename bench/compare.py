"""The standard routing comparison: ``python bench/compare.py [options]``.

The same as ``python -m bench.sim`` (see ``bench/sim/__main__.py`` and bench/README.md),
for those who run benchmarks as files.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ is not an installed package: make ``import bench.sim`` work from a file run.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
