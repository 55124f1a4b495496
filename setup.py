"""The optional C extension gradpipe.core._kernels: per-element loops without the GIL.

Everything else about the package is in pyproject.toml. ``optional=True``: where no C compiler
is found the build goes on without the extension (``pip install -v`` shows the warning), and
gradpipe runs its numpy versions of the same loops (slower; the same frames and statistics,
but for the last bits of float sums). After editing _kernels.c in a checkout installed with
``pip install -e .``, run that again: the built module sits beside the source.
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gradpipe.core._kernels",
            ["gradpipe/core/_kernels.c"],
            # No fused multiply-adds: chunk statistics round the same on every machine.
            extra_compile_args=[] if os.name == "nt" else ["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
