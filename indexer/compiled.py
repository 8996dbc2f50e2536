"""Which implementation of the memory table's probing runs: compiled or pure numpy.

``kvindex.indexer._probe`` (indexer/_probe.c) is built by ``pip install`` when a C
compiler is present and skipped otherwise (setup.py marks it optional). Both paths keep
the same table invariants and give the same answers; the compiled one is several times
faster at inserting fresh keys and rebuilding (bench/bench_ingest.py). ``kvindex
--version`` and the startup line say which one runs.

Tests run the table with both (``tests/test_memory_table_paths.py``) by swapping
:data:`probe` for None.
"""

from __future__ import annotations

from types import ModuleType

try:
    from kvindex.indexer import _probe as _compiled
except ImportError:  # built without a compiler: the numpy path runs
    _compiled = None

#: The compiled kernels, or None when the pure-numpy path runs.
probe: ModuleType | None = _compiled


def implementation() -> str:
    """``"compiled"`` or ``"numpy"``: the probing path this process runs."""
    return "compiled" if probe is not None else "numpy"
