"""The optional C extension gradpipe.core._kernels: per-element loops without the GIL.

Everything else about the package is in pyproject.toml. ``optional=True``: where no C compiler
is found the build goes on without the extension, and gradpipe runs its numpy versions of the
same loops (slower, same results).
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gradpipe.core._kernels",
            ["gradpipe/core/_kernels.c"],
            extra_compile_args=[] if os.name == "nt" else ["-O3"],
            optional=True,
        )
    ]
)
