"""Build hook for the optional C accelerator (everything else is in pyproject.toml).

``upsycle_router._accel`` is built where a C compiler and the Python headers exist; ``optional=True`` lets
the install go on without it elsewhere, and the package then runs its Python implementations
(upsycle_router/accel.py says which one is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "upsycle_router._accel",
            ["upsycle_router/_accel.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
