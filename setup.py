"""Build hook for the optional C accelerators (everything else is in pyproject.toml).

Each layer's hot path has its own extension module, next to the Python code that uses it (and its ``.pyi``
stub, its Python twin in that layer's ``accel.py``; ``upsycle_router/cext.py`` lists them):

``upsycle_router.wire._codec``      frames decoded, message ids hashed (with the vendored BLAKE3)
``upsycle_router.runtime._verify``  signatures verified in batches
``upsycle_router.store._records``   the store's records of new messages; bulk index writes sorted
``upsycle_router.store._idindex``   the store's id index in memory
``upsycle_router.transport._fanout`` one fan-out's bytes sent to many sockets in one call
``upsycle_router.analytics._canonical`` trace lines in the routers' own form cut into columns (analyze)

They are built where a C compiler and the Python headers exist; ``optional=True`` lets the install go on
without one elsewhere, and the package then runs the Python twin of what is missing (``upsycle_router.accel``
says which implementation runs).

``_codec`` includes the official C implementation of BLAKE3 (``vendor/blake3``): on x86-64 Unix with its
assembly (SSE2 to AVX-512, picked at run time), on AArch64 with NEON, elsewhere the portable code.
"""

import platform
import struct
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

B3 = "vendor/blake3/"
blake3_sources = [B3 + "blake3.c", B3 + "blake3_dispatch.c", B3 + "blake3_portable.c"]
blake3_macros: list[tuple[str, str | None]] = []
# The machine the interpreter was built for: a 64-bit kernel may run a 32-bit userland (pointer size 4).
machine = platform.machine().lower() if struct.calcsize("P") == 8 else ""
if machine in ("x86_64", "amd64") and sys.platform != "win32":
    blake3_sources += [B3 + f"blake3_{isa}_x86-64_unix.S" for isa in ("sse2", "sse41", "avx2", "avx512")]
elif machine in ("aarch64", "arm64"):
    blake3_sources.append(B3 + "blake3_neon.c")
else:
    blake3_macros += [("BLAKE3_USE_NEON", "0")] + [
        (f"BLAKE3_NO_{isa}", None) for isa in ("SSE2", "SSE41", "AVX2", "AVX512")
    ]

WIRE, RUNTIME, STORE = "upsycle_router/wire/", "upsycle_router/runtime/", "upsycle_router/store/"
TRANSPORT = "upsycle_router/transport/"
ANALYTICS = "upsycle_router/analytics/"


def accelerator(name: str, sources: list[str], include_dirs: list[str], depends: list[str],
                macros: list[tuple[str, str | None]] | None = None) -> Extension:
    return Extension(name, sources, include_dirs=include_dirs, define_macros=macros or [], depends=depends,
                     optional=True, extra_compile_args=["-O2"])


class BuildExt(build_ext):
    """build_ext that also assembles ``.S`` files (the C compiler driver preprocesses and assembles them) and,
    on Linux, exports nothing but each module's init function: the BLAKE3 functions stay private."""

    def build_extensions(self) -> None:
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions.append(".S")
        if sys.platform.startswith("linux"):
            for ext in self.extensions:
                short = ext.name.rsplit(".", 1)[-1]
                script = Path(self.build_temp) / f"exports-{ext.name}.map"
                script.parent.mkdir(parents=True, exist_ok=True)
                script.write_text(f"{{\n  global: PyInit_{short};\n  local: *;\n}};\n")
                ext.extra_link_args = [*(ext.extra_link_args or []), f"-Wl,--version-script={script}"]
        super().build_extensions()


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        accelerator("upsycle_router.wire._codec", [WIRE + "_codec.c", *blake3_sources], [WIRE, B3],
                    [WIRE + "_message.h", B3 + "blake3.h", B3 + "blake3_impl.h"], blake3_macros),
        accelerator("upsycle_router.runtime._verify", [RUNTIME + "_verify.c"], [WIRE], [WIRE + "_message.h"]),
        accelerator("upsycle_router.store._records", [STORE + "_records.c"], [STORE], [STORE + "_layout.h"]),
        accelerator("upsycle_router.store._idindex", [STORE + "_idindex.c"], [STORE], [STORE + "_layout.h"]),
        accelerator("upsycle_router.transport._fanout", [TRANSPORT + "_fanout.c"], [], []),
        accelerator("upsycle_router.analytics._canonical", [ANALYTICS + "_canonical.c"], [], []),
    ],
)
