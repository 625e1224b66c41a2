"""What pyproject.toml cannot yet say in a stable form: the loader's optional C kernel.

``packer/training/_rowkernel.c`` decodes a packed row in one call (``packer/training/decode.py``). It
is optional: where no C compiler is found the install goes on without it, and numpy decodes the same
values, slower (``benchmarks/bench_loader.py`` measures both; docs/loader.md, "Speed", says how to see
which one runs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("packer.training._rowkernel", ["packer/training/_rowkernel.c"], optional=True,
                             extra_compile_args=["-O3"])])
