"""Build hook for the optional C accelerator (everything else is in pyproject.toml).

``upsycle_router._accel`` is built where a C compiler and the Python headers exist; ``optional=True`` lets
the install go on without it elsewhere, and the package then runs its Python implementations
(upsycle_router/accel.py says which one is in use).

It includes the official C implementation of BLAKE3 (``vendor/blake3``): on x86-64 Unix with its assembly
(SSE2 to AVX-512, picked at run time), on AArch64 with NEON, elsewhere the portable code.
"""

import platform
import struct
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

B3 = "vendor/blake3/"
sources = ["upsycle_router/_accel.c", B3 + "blake3.c", B3 + "blake3_dispatch.c", B3 + "blake3_portable.c"]
macros: list[tuple[str, str | None]] = []
# The machine the interpreter was built for: a 64-bit kernel may run a 32-bit userland (pointer size 4).
machine = platform.machine().lower() if struct.calcsize("P") == 8 else ""
if machine in ("x86_64", "amd64") and sys.platform != "win32":
    sources += [B3 + f"blake3_{isa}_x86-64_unix.S" for isa in ("sse2", "sse41", "avx2", "avx512")]
elif machine in ("aarch64", "arm64"):
    sources.append(B3 + "blake3_neon.c")
else:
    macros += [("BLAKE3_USE_NEON", "0")] + [(f"BLAKE3_NO_{isa}", None) for isa in ("SSE2", "SSE41", "AVX2", "AVX512")]


class BuildExt(build_ext):
    """build_ext that also assembles ``.S`` files (the C compiler driver preprocesses and assembles them) and,
    on Linux, exports nothing but the module's init function: the BLAKE3 functions stay private."""

    def build_extensions(self) -> None:
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions.append(".S")
        if sys.platform.startswith("linux"):
            script = Path(self.build_temp) / "exports.map"
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text("{\n  global: PyInit__accel;\n  local: *;\n};\n")
            for ext in self.extensions:
                ext.extra_link_args = [*(ext.extra_link_args or []), f"-Wl,--version-script={script}"]
        super().build_extensions()


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "upsycle_router._accel",
            sources,
            include_dirs=[B3],
            define_macros=macros,
            depends=[B3 + "blake3.h", B3 + "blake3_impl.h"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ],
)
