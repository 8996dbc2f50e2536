"""Build hook for the one compiled module; everything else is in pyproject.toml.

``kvindex.indexer._probe`` (indexer/_probe.c, the memory table's probing kernels) is
optional: without a C compiler ``pip install`` still succeeds and kvindex runs the
pure-numpy path, which gives identical answers (``kvindex --version`` says which runs).
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
        )
    ]
)
