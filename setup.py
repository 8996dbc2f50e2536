"""Build hook for the compiled modules; everything else is in pyproject.toml.

``kvindex.indexer._probe`` (indexer/_probe.c, the memory table's probing kernels) and
``kvindex.events._wire_scan`` (events/_wire_scan.c, the KV-event payload scanner) are
optional: without a C compiler ``pip install`` still succeeds and kvindex runs the
pure-numpy table and the msgspec decoder, which give identical answers (``kvindex
--version`` says which runs).
setuptools reads extension modules from setup.py on every version this project
supports (its pyproject.toml form is still marked experimental).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvindex.indexer._probe",
            sources=["indexer/_probe.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvindex.events._wire_scan",
            sources=["events/_wire_scan.c"],
            depends=["events/_wire_scan_read.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
