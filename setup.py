"""Builds tokenpath's optional native CPU kernels (src/tokenpath/engine/kernels/csrc).

Everything else about the package lives in pyproject.toml; this file only adds the extensions:
the same sources built twice, `_native_avx2` (AVX2 kernels only) and `_native_avx512` (AVX-512
VNNI and AVX2), so that a compiler which cannot build the AVX-512 file still leaves the AVX2 one.
It is optional on purpose: with TOKENPATH_NO_KERNELS=1, or when the compiler fails, the package
still installs and the engine runs on its torch float32 path (it logs one line saying so).
The library has no Python or PyTorch API: tokenpath loads it with ctypes and passes pointers.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PKG = "src/tokenpath/engine/kernels"
CSRC = f"{PKG}/csrc"


class OptionalBuildExt(build_ext):
    """A failed kernel build is a warning, not a failed install, and per extension: the AVX2
    object does not depend on the compiler accepting the AVX-512 file."""

    def run(self) -> None:
        # Serial: build_extension below points build_temp at the extension's own folder, which
        # threads building extensions at once (--parallel) would overwrite under each other.
        self.parallel = None
        if self.inplace:
            _remove_stale_single_object()
        try:
            super().run()
        except Exception as exc:  # compiler missing, unsupported platform, ...
            print(f"tokenpath: native kernels not built ({exc}); the engine will use torch float32",
                  file=sys.stderr)

    def build_extensions(self) -> None:
        # The two objects share quant.cpp and dot_avx2.cpp, compiled with the same arguments: the
        # second extension copies the first one's .o instead of compiling them again (a minute on
        # 2 cores). Keyed by the whole command, so a change of source, flags or macros compiles.
        compile_one = getattr(self.compiler, "_compile", None)
        if compile_one is not None:
            done: dict[tuple, str] = {}

            def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts) -> None:
                key = (os.path.abspath(src), tuple(cc_args), tuple(extra_postargs), tuple(pp_opts))
                if key in done and os.path.isfile(done[key]):
                    shutil.copyfile(done[key], obj)
                    return
                compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)
                done[key] = obj

            self.compiler._compile = _compile
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        # Each extension has its own object folder (forward.o differs between them): the cache in
        # build_extensions shares only what compiled identically, by copying.
        build_temp = self.build_temp
        self.build_temp = os.path.join(build_temp, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"tokenpath: native kernels {ext.name} not built ({exc})", file=sys.stderr)
        finally:
            self.build_temp = build_temp


def _remove_stale_single_object() -> None:
    """Builds before the split made one `_native` object; the loader ignores it, and an in-place
    build removes it so that it is not mistaken for a current one."""
    for old in Path(PKG).glob("_native.*"):
        if old.suffix in (".so", ".pyd"):
            print(f"tokenpath: removing {old} (the single kernel object of an older build)", file=sys.stderr)
            old.unlink()


def _kernel_extension(name: str, files: tuple[str, ...]) -> Extension:
    return Extension(
        f"tokenpath.engine.kernels.{name}",
        sources=[f"{CSRC}/{f}" for f in files],
        depends=[str(p) for p in sorted(Path(CSRC).iterdir()) if p.suffix in (".h", ".cpp")],
        # No -march: the ISA-specific files carry their own target pragmas and the library picks
        # at run time, so a wheel built here also runs on an AVX2-only machine.
        extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"],
        extra_link_args=["-fopenmp"],
        language="c++",
        # A failed build is a warning (setuptools' own handling, with the except in
        # OptionalBuildExt.build_extension), and --inplace then copies the objects that were built.
        optional=True,
    )


def extensions() -> list[Extension]:
    """Two objects from csrc/, each built (or failing) on its own; kernels/library.py loads the
    best one the CPU runs: _native_avx512 (AVX-512 VNNI and AVX2 kernels) or _native_avx2 (no
    AVX-512 code at all: forward_avx2.cpp is forward.cpp without the AVX-512 dispatch)."""
    if os.environ.get("TOKENPATH_NO_KERNELS") == "1" or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return [
        _kernel_extension("_native_avx2", ("quant.cpp", "quantize_more.cpp", "dot_avx2.cpp", "forward_avx2.cpp", "bpe.cpp")),
        _kernel_extension("_native_avx512", ("quant.cpp", "quantize_more.cpp", "dot_avx2.cpp", "dot_avx512.cpp", "amx_bf16.cpp", "bf16_dot.cpp", "attn_amx.cpp", "attn_avx512.cpp", "forward.cpp", "bpe.cpp")),
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
