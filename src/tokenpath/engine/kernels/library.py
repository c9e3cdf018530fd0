"""Finding and loading the native kernel objects.

setup.py builds csrc/ twice: `_native_avx512` (AVX-512 VNNI and AVX2 kernels) and `_native_avx2`
(compiled without any AVX-512 code, so a compiler that cannot build dot_avx512.cpp still leaves
it). Either may be missing. `load_library` opens the best one this CPU runs: the AVX-512 object on
a CPU with AVX-512 VNNI, else the AVX2 one (or, with only the AVX-512 object built, its AVX2
kernels), and logs one line naming the file and its kernels.

The object is loaded once per process; the kernel set is chosen per model (`NativeLibrary.isa`),
so forcing AVX2 (`--kernels-isa avx2`, TOKENPATH_KERNELS_ISA=avx2) runs the AVX2 kernels of
whichever object is loaded: the AVX-512 object's AVX2 kernels are compiled from the same sources
with the same flags as the AVX2 object's, and one process can compare both kernel sets (the
tests do).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenpath.config import env_no_kernels, kernel_isa_from_env
from tokenpath.engine.kernels import abi

log = logging.getLogger("tokenpath.engine.kernels")

ISA_AVX2, ISA_AVX512 = 1, 2
ISA_NAMES = {ISA_AVX2: "AVX2", ISA_AVX512: "AVX-512 VNNI"}
FEATURE_AVX2, FEATURE_AVX512_VNNI, FEATURE_F16C, FEATURE_AMX_BF16, FEATURE_AVX512_BF16 = 1, 2, 4, 8, 16  # tp_cpu_features()
KERNELS_AMX_BF16 = 4  # bit of tp_kernel_isas(): the object carries the AMX-BF16 GEMM
KERNELS_BF16_DOT = 8  # bit of tp_kernel_isas(): the object carries the VDPBF16PS GEMM (csrc/bf16_dot.cpp)
PACKAGE_DIR = Path(__file__).parent
# The extension modules setup.py builds, by the best kernel set each carries.
OBJECTS = {ISA_AVX512: "_native_avx512", ISA_AVX2: "_native_avx2"}
STALE_OBJECT = "_native"  # the single object of builds before the split: never loaded


@dataclass(frozen=True)
class NativeLibrary:
    lib: ctypes.CDLL
    # FEATURE_* bits the kernels can use here: AVX2+FMA, AVX-512 VNNI (only when the CPU has it
    # and this object carries those kernels), F16C (a float16 KV cache), AMX-BF16 (granted to this
    # process, and the object carries the tile GEMM), AVX512_BF16 (the object carries its GEMM)
    features: int
    path: Path | None = None  # the object loaded
    cpu_features: int = 0  # tp_cpu_features(): what the CPU has, whatever the object carries

    def isa(self, requested: str | None = None) -> int:
        """The kernel set to run: `requested` (avx2 | avx512 | auto; default TOKENPATH_KERNELS_ISA,
        else auto) within what the CPU and this object have."""
        want = (requested or kernel_isa_from_env()).lower()
        if want == "avx2" or not self.features & FEATURE_AVX512_VNNI:
            return ISA_AVX2
        return ISA_AVX512

    @property
    def has_f16c(self) -> bool:
        """Whether a float16 KV cache can run: its conversions are F16C instructions."""
        return bool(self.features & FEATURE_F16C)

    @property
    def has_amx_bf16(self) -> bool:
        """Whether BF16 weights can multiply bf16 activations on AMX tiles (csrc/amx_bf16.cpp)."""
        return bool(self.features & FEATURE_AMX_BF16)

    @property
    def has_bf16_dot(self) -> bool:
        """Whether BF16 weights can multiply bf16 activations on VDPBF16PS (csrc/bf16_dot.cpp, AVX512_BF16
        CPUs without AMX, e.g. AMD Zen 4): the same precision as the tiles, for BF16 weights only."""
        return bool(self.features & FEATURE_AVX512_BF16)

    def available_isas(self) -> list[int]:
        return [ISA_AVX2] + ([ISA_AVX512] if self.features & FEATURE_AVX512_VNNI else [])


def object_path(directory: Path, stem: str) -> Path | None:
    """`stem` built for this interpreter in `directory` (its extension-module suffixes, in order)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / (stem + suffix)
        if path.is_file():
            return path
    return None


def _open(path: Path) -> NativeLibrary | None:
    """One object, checked (its model ABI, every function of abi.SIGNATURES), or None with a warning."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("native kernels at %s failed to load (%s)", path, exc)
        return None
    lib.tp_model_abi.restype = ctypes.c_int
    version = lib.tp_model_abi() if hasattr(lib, "tp_model_abi") else 1
    if version != abi.MODEL_ABI:
        log.warning("native kernels at %s are stale (model ABI %d, this code needs %d; rebuild: python setup.py "
                    "build_ext --inplace)", path, version, abi.MODEL_ABI)
        return None
    try:
        abi.apply(lib)
    except AttributeError as exc:
        log.warning("native kernels at %s lack a function (%s; rebuild)", path, exc)
        return None
    cpu = lib.tp_cpu_features()
    carried = lib.tp_kernel_isas()
    usable = cpu if carried & ISA_AVX512 else cpu & ~(FEATURE_AVX512_VNNI | FEATURE_AMX_BF16 | FEATURE_AVX512_BF16)
    if not carried & KERNELS_AMX_BF16:
        usable &= ~FEATURE_AMX_BF16
    if not carried & KERNELS_BF16_DOT:
        usable &= ~FEATURE_AVX512_BF16
    return NativeLibrary(lib=lib, features=usable, path=path, cpu_features=cpu)


def load_library(directory: Path = PACKAGE_DIR) -> NativeLibrary | None:
    """The best kernel object in `directory` for this CPU, or None with one log line saying why
    the engine falls back to torch. Uncached: `native_library()` is the process's one."""
    if env_no_kernels():
        log.warning("native kernels switched off (TOKENPATH_NO_KERNELS=1): using the torch float32 path")
        return None
    found = {isa: path for isa, stem in OBJECTS.items() if (path := object_path(directory, stem))}
    if not found:
        stale = object_path(directory, STALE_OBJECT)
        log.warning("native kernels are not built%s (reinstall without TOKENPATH_NO_KERNELS, with g++): "
                    "using the torch float32 path",
                    f" (only {stale.name}, from an older build, which is not loaded)" if stale else "")
        return None
    # The AVX2 object first where it exists: it holds no AVX-512 code, so it loads on any CPU and
    # says (tp_cpu_features) whether the AVX-512 one is worth opening.
    lib = _open(found[ISA_AVX2]) if ISA_AVX2 in found else None
    if ISA_AVX512 in found and (lib is None or lib.cpu_features & FEATURE_AVX512_VNNI):
        lib = _open(found[ISA_AVX512]) or lib
    if lib is None:
        log.warning("no native kernel object loaded: using the torch float32 path")
        return None
    if not lib.features & FEATURE_AVX2:
        log.warning("this CPU lacks AVX2+FMA: using the torch float32 path")
        return None
    best = max(lib.available_isas())
    note = ""
    if lib.cpu_features & FEATURE_AVX512_VNNI and best != ISA_AVX512:
        note = (f"; this CPU has AVX-512 VNNI, but {OBJECTS[ISA_AVX512]} is not built here (or failed to load): "
                "rebuild with a compiler that supports it for the faster kernels")
    log.info("native kernels: %s (%s kernels%s)", lib.path.name if lib.path else "?", ISA_NAMES[best], note)
    return lib


@functools.cache
def native_library() -> NativeLibrary | None:
    """The process's kernels (`load_library` of the package's own objects, once)."""
    return load_library()
