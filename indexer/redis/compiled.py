"""Which Redis lookup path runs: compiled (indexer/redis/_redis_lookup.c) or numpy + hiredis.

``kvindex.indexer.redis._redis_lookup`` is built by ``pip install`` when a C compiler is
present and skipped otherwise (setup.py marks it optional). It packs a lookup's HMGETs,
reads MULTI/EXEC's answer straight from the socket's bytes and walks the bitmaps; the
pure path (:mod:`kvindex.indexer.redis.wire`'s reply readers, numpy in
:mod:`kvindex.indexer.redis.read` and :mod:`kvindex.indexer.redis.walk`) gives
identical answers. Tests run both (``tests/test_redis_compiled.py``) by building a
:class:`~kvindex.indexer.redis.connection.RedisConnection` with ``compiled=False``.
"""

from __future__ import annotations

from types import ModuleType

try:
    from kvindex.indexer.redis import _redis_lookup as _compiled
except ImportError:  # built without a compiler: the numpy and hiredis path runs
    _compiled = None

#: The compiled lookup kernels, or None when the pure path runs.
kernels: ModuleType | None = _compiled


def implementation() -> str:
    """``"compiled"`` or ``"numpy"``: the Redis lookup path this process runs."""
    return "compiled" if kernels is not None else "numpy"
