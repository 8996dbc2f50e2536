"""Which implementations run: compiled or pure Python, for the table and for hashing.

``kvindex.indexer.memory._probe`` (indexer/memory/_probe.c: the memory table's probing, update, walk
and rebuild kernels) and ``kvindex.indexer._chain`` (indexer/_chain.c: vLLM's block-hash
chain, SHA-256 from OpenSSL's libcrypto) are built by ``pip install`` when a C compiler
(and, for the chain, OpenSSL's headers) is present, and skipped otherwise (setup.py marks
them optional). Each gives the same answers as its pure path, which stays the reference
(bench/README.md has the speed-ups).

``kvindex --version`` and the startup line say which ones run
(:func:`kvindex.api.version.implementations`). Tests run both paths
(``tests/test_memory_table_paths.py``,
``tests/test_keys_compiled.py``) by swapping :data:`probe` or :data:`chain` for None.
"""

from __future__ import annotations

from types import ModuleType

try:
    from kvindex.indexer.memory import _probe as _compiled
except ImportError:  # built without a compiler: the numpy path runs
    _compiled = None
try:
    from kvindex.indexer import _chain as _compiled_chain
except ImportError:  # built without a compiler or OpenSSL headers: pickle + hashlib run
    _compiled_chain = None

#: The compiled kernels, or None when the pure-numpy path runs.
probe: ModuleType | None = _compiled
#: The compiled hash chain, or None when the pure-Python path runs.
chain: ModuleType | None = _compiled_chain


def implementation() -> str:
    """``"compiled"`` or ``"numpy"``: the probing path this process runs."""
    return "compiled" if probe is not None else "numpy"


def hashing() -> str:
    """``"compiled"`` or ``"python"``: the block-hash path this process runs."""
    return "compiled" if chain is not None else "python"
