"""Build hook for the compiled modules; everything else is in pyproject.toml.

All six are optional: without a C compiler (or OpenSSL's headers, for the hash chain)
``pip install`` still succeeds and kvindex runs the pure path, which gives identical
answers (``kvindex --version`` says which runs):

- ``kvindex.indexer.memory._probe`` (indexer/memory/_probe.c): the memory table's probing kernels;
- ``kvindex.indexer._chain`` (indexer/_chain.c): vLLM's block-hash chain, hashed with
  OpenSSL's libcrypto (libssl-dev to build, libssl3 at run time; Python's own ssl
  module needs the latter anyway);
- ``kvindex.events.wire._wire_scan`` (events/wire/_wire_scan.c): the KV-event payload scanner
  (the msgspec decoder otherwise), and the receiver's drain straight from the libzmq
  pyzmq loaded (pyzmq's receive otherwise);
- ``kvindex.indexer.redis._redis_lookup`` (indexer/redis/_redis_lookup.c): the Redis lookup's
  client side (HMGET packing, reply reading, the walk; numpy and hiredis otherwise);
- ``kvindex.api.http._json_tokens`` (api/http/_json_tokens.c): a JSON ``/score`` or ``/route``
  body's ``token_ids`` read into uint32s (msgspec decodes the whole body otherwise);
- ``kvindex.scoring.route._route_pass`` (scoring/route/_route_pass.c): ``/route``'s loop over the
  candidate pods (scoring/route/one_pass.py runs it in Python otherwise).

``KVINDEX_PURE_PYTHON=1`` builds none of them: the install a machine without a compiler
gets, on purpose (.ci/run tests the pure paths in such a venv). setuptools reads
extension modules from setup.py on every version this project supports (its
pyproject.toml form is still marked experimental).
"""

import os

from setuptools import Extension, setup

_PURE = os.environ.get("KVINDEX_PURE_PYTHON", "")
if _PURE not in ("", "0", "1"):
    raise SystemExit(f"KVINDEX_PURE_PYTHON={_PURE!r}: use 1 (build no C modules) or 0")

EXTENSIONS = [
    Extension(
        "kvindex.indexer.memory._probe",
        sources=["indexer/memory/_probe.c"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
    Extension(
        "kvindex.indexer._chain",
        sources=["indexer/_chain.c"],
        depends=["indexer/_chain_writer.h", "indexer/_chain_pickle.h", "indexer/_chain_cbor.h"],
        extra_compile_args=["-O3"],
        libraries=["crypto"],
        optional=True,
    ),
    Extension(
        "kvindex.events.wire._wire_scan",
        sources=["events/wire/_wire_scan.c"],
        depends=[
            "events/wire/_wire_scan_read.h",
            "events/wire/_wire_scan_merge.h",
            "events/wire/_wire_scan_zmq.h",
        ],
        extra_compile_args=["-O3"],
        libraries=["dl"],  # dlopen/dlsym: libzmq through pyzmq (glibc < 2.34)
        optional=True,
    ),
    Extension(
        "kvindex.indexer.redis._redis_lookup",
        sources=["indexer/redis/_redis_lookup.c"],
        depends=[
            "indexer/redis/_redis_resp.h",
            "indexer/redis/_redis_rows.h",
            "indexer/redis/_redis_io.h",
            "indexer/redis/_redis_presence.h",
        ],
        extra_compile_args=["-O3"],
        optional=True,
    ),
    Extension(
        "kvindex.scoring.route._route_pass",
        sources=["scoring/route/_route_pass.c"],
        # The loop's doubles must round as Python's do: no fused multiply-add.
        extra_compile_args=["-O3", "-ffp-contract=off"],
        optional=True,
    ),
    Extension(
        "kvindex.api.http._json_tokens",
        sources=["api/http/_json_tokens.c"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
]

if _PURE == "1":
    # A build folder of its own: a compiled build's .so files in build/lib would
    # otherwise go into this wheel too.
    setup(ext_modules=[], options={"build": {"build_base": "build/pure"}})
else:
    setup(ext_modules=EXTENSIONS)
