"""Build hook for the optional C leaf walk (kvmigrate/_leafwalk.c).

Everything else is in pyproject.toml. The extension is `optional`: where no C compiler
or Python headers are found, `pip install` still succeeds and scan uses its Python walk.
On x86 the vendored xxHash dispatcher picks SSE2, AVX2 or AVX-512 at run time (built
with baseline flags, so the module runs on any x86-64 CPU).
"""

import re
import sysconfig

from setuptools import Extension, setup

XXHASH = "kvmigrate/_vendor/xxhash"
sources = ["kvmigrate/_leafwalk.c", f"{XXHASH}/xxhash.c"]
macros = []
if re.search(r"x86_64|amd64|i[3-6]86", sysconfig.get_platform().lower()):
    sources.append(f"{XXHASH}/xxh_x86dispatch.c")
    macros.append(("KVMIGRATE_XXH_X86_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "kvmigrate._leafwalk",
            sources,
            include_dirs=[XXHASH],
            depends=["kvmigrate/_blockrows.h"],  # (a changed header rebuilds the module)
            define_macros=macros,
            extra_compile_args=["-O2", "-fvisibility=hidden"],  # (only PyInit_ is exported)
            optional=True,
        )
    ]
)
