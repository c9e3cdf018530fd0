"""Builds tokenpath's optional native CPU kernels (src/tokenpath/engine/kernels/csrc).

Everything else about the package lives in pyproject.toml; this file only adds the extension.
It is optional on purpose: with TOKENPATH_NO_KERNELS=1, or when the compiler fails, the package
still installs and the engine runs on its torch float32 path (it logs one line saying so).
The library has no Python or PyTorch API: tokenpath loads it with ctypes and passes pointers.
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "src/tokenpath/engine/kernels/csrc"


class OptionalBuildExt(build_ext):
    """A failed kernel build is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, unsupported platform, ...
            print(f"tokenpath: native kernels not built ({exc}); the engine will use torch float32",
                  file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"tokenpath: native kernels not built ({exc}); the engine will use torch float32",
                  file=sys.stderr)


def extensions() -> list[Extension]:
    if os.environ.get("TOKENPATH_NO_KERNELS") == "1" or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return [Extension(
        "tokenpath.engine.kernels._native",
        sources=[f"{CSRC}/{f}" for f in ("quant.cpp", "dot_avx2.cpp", "dot_avx512.cpp", "forward.cpp")],
        depends=[f"{CSRC}/tp_kernels.h", f"{CSRC}/dot_impl.h", f"{CSRC}/packed_impl.h", f"{CSRC}/attention.h",
                 f"{CSRC}/vec_math.h", f"{CSRC}/kquant_impl.h", f"{CSRC}/lora_delta.h"],
        # No -march: the ISA-specific files carry their own target pragmas and the library picks
        # at run time, so a wheel built here also runs on an AVX2-only machine.
        extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"],
        extra_link_args=["-fopenmp"],
        language="c++",
    )]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
