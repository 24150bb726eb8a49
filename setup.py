"""Build hook for the optional C leaf walk (kvmigrate/_leafwalk.c).

Everything else is in pyproject.toml. The extension is `optional`: where no C compiler
or Python headers are found, `pip install` still succeeds and scan uses its Python walk.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvmigrate._leafwalk",
            ["kvmigrate/_leafwalk.c"],
            include_dirs=["kvmigrate/_vendor/xxhash"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
