"""The two kernel objects (setup.py: `_native_avx2`, `_native_avx512`) and the kernel knobs.

The loader opens the best object the CPU runs and says which, in one line; with only the AVX2
object built (a compiler that could not build the AVX-512 file) the engine still runs the native
kernels, on AVX2; an old single `_native` object is never loaded. The knobs (EngineConfig's
kernels_isa, kernels_fine, kernels_exact) default to their TOKENPATH_KERNELS_* variables and
reach the native model from the config.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.engine.native_steps import NativeSteps
from tokenpath.config import EngineConfig
from tokenpath.engine import kernels as K
from tokenpath.engine.kernels.library import OBJECTS, PACKAGE_DIR, load_library, object_path

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")
AVX2_OBJECT = object_path(PACKAGE_DIR, OBJECTS[K.ISA_AVX2])
AVX512_OBJECT = object_path(PACKAGE_DIR, OBJECTS[K.ISA_AVX512])
LOGGER = "tokenpath.engine.kernels"


def only(tmp_path, obj, name: str | None = None):
    """A folder holding a copy of one kernel object (under `name`, else its own)."""
    shutil.copy(obj, tmp_path / (name or obj.name))
    return tmp_path


def test_the_loader_names_the_object_and_kernels_it_loaded(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = load_library()
    assert got is not None and got.path is not None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    best = max(got.available_isas())
    assert got.path.name in lines[0] and f"({K.ISA_NAMES[best]} kernels" in lines[0]
    # The best object for this CPU: AVX-512 where the CPU has VNNI (and it was built), else AVX2.
    want = K.ISA_AVX512 if got.cpu_features & K.FEATURE_AVX512_VNNI and AVX512_OBJECT else K.ISA_AVX2
    assert got.path.name.startswith(OBJECTS[want] + ".") or (want == K.ISA_AVX2 and AVX2_OBJECT is None)
    assert got.path == lib.path  # the process's library is the same choice


@pytest.mark.requires("avx2_object")
def test_with_only_the_avx2_object_the_engine_runs_avx2_kernels(tmp_path, caplog, monkeypatch, tiny_llama):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        avx2 = load_library(only(tmp_path, AVX2_OBJECT))
    assert avx2 is not None and avx2.path == tmp_path / AVX2_OBJECT.name
    assert avx2.lib.tp_kernel_isas() == 1 and avx2.available_isas() == [K.ISA_AVX2]
    assert avx2.isa("avx512") == avx2.isa("auto") == K.ISA_AVX2
    [line] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert AVX2_OBJECT.name in line and "(AVX2 kernels" in line
    if avx2.cpu_features & K.FEATURE_AVX512_VNNI:  # says what is missing
        assert "this CPU has AVX-512 VNNI, but _native_avx512 is not built" in line
    # The engine's runner on that object: native, AVX2, and the same logits as the package's
    # library forced to AVX2 (the same kernels from the same sources).
    monkeypatch.setattr("tokenpath.engine.kernels.model.native_library", lambda: avx2)
    steps = NativeSteps(tiny_llama, "float32", num_blocks=4, max_len=64, kernels_isa="auto")
    native = steps.runner.native
    assert native is not None and native.lib is avx2 and native.isa == K.ISA_AVX2
    got = steps.step([([0, 1], list(range(3, 30)), 0)])
    monkeypatch.undo()
    ref = NativeSteps(tiny_llama, "float32", num_blocks=4, max_len=64, kernels_isa="avx2")
    # (the package's library now: a test elsewhere may have cleared native_library's cache since import)
    assert ref.runner.native is not None and ref.runner.native.lib is K.native_library()
    assert np.array_equal(got.numpy(), ref.step([([0, 1], list(range(3, 30)), 0)]).numpy())


@pytest.mark.requires("avx512_object")
def test_with_only_the_avx512_object_it_runs_what_the_cpu_has(tmp_path):
    got = load_library(only(tmp_path, AVX512_OBJECT))
    # AVX2, AVX-512 VNNI, the AMX-BF16 GEMM, the VDPBF16PS one
    assert got is not None and got.lib.tp_kernel_isas() == 1 | 2 | 4 | 8
    want = [K.ISA_AVX2, K.ISA_AVX512] if got.cpu_features & K.FEATURE_AVX512_VNNI else [K.ISA_AVX2]
    assert got.available_isas() == want
    # The tiles where the CPU has them and Linux grants them to this process (tp_cpu_features).
    assert got.has_amx_bf16 == bool(got.cpu_features & K.FEATURE_AMX_BF16)
    assert got.has_amx_bf16 == (" amx_bf16" in Path("/proc/cpuinfo").read_text())
    # VDPBF16PS where the CPU has AVX512_BF16 (AMX CPUs have it too: the tiles are taken first)
    assert got.has_bf16_dot == bool(got.cpu_features & K.FEATURE_AVX512_BF16)
    assert got.has_bf16_dot == (" avx512_bf16" in Path("/proc/cpuinfo").read_text())


@pytest.mark.requires("avx2_object")
def test_the_avx2_object_never_offers_bf16_activations(tmp_path):
    got = load_library(only(tmp_path, AVX2_OBJECT))
    assert got is not None and not got.has_amx_bf16 and not got.has_bf16_dot


def test_an_old_single_object_is_not_loaded(tmp_path, caplog):
    """Builds before the split made `_native.<suffix>.so`; one left in a checkout is named in the
    warning, never loaded (its ABI could be anything)."""
    stale = "_native" + AVX2_OBJECT.name.removeprefix("_native_avx2") if AVX2_OBJECT else "_native.so"
    (tmp_path / stale).write_bytes(b"not a library")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_library(tmp_path) is None
    assert f"only {stale}, from an older build" in caplog.text


def test_kernel_knobs_default_to_their_environment_variables(monkeypatch):
    for name in ("TOKENPATH_KERNELS_ISA", "TOKENPATH_KERNELS_FINE", "TOKENPATH_KERNELS_EXACT"):
        monkeypatch.delenv(name, raising=False)
    c = EngineConfig()
    assert (c.kernels_isa, c.kernels_fine, c.kernels_exact) == ("auto", None, None)
    monkeypatch.setenv("TOKENPATH_KERNELS_ISA", "AVX2")
    monkeypatch.setenv("TOKENPATH_KERNELS_FINE", "all")
    monkeypatch.setenv("TOKENPATH_KERNELS_EXACT", "0x8")
    c = EngineConfig()
    assert (c.kernels_isa, c.kernels_fine, c.kernels_exact) == ("avx2", 31, 8)
    monkeypatch.setenv("TOKENPATH_KERNELS_ISA", "neon")  # as the variable always read: auto
    monkeypatch.setenv("TOKENPATH_KERNELS_FINE", "1")  # the variable's 1: all five matmuls
    c = EngineConfig()
    assert (c.kernels_isa, c.kernels_fine) == ("auto", 31)
    assert EngineConfig(kernels_fine=1).kernels_fine == 1  # a given mask is the mask
    with pytest.raises(ValueError):
        EngineConfig(kernels_exact=32)


def test_the_config_reaches_the_native_model_over_the_environment(monkeypatch, tiny_llama):
    """Given fields win over the variables, which are only their defaults."""
    monkeypatch.setenv("TOKENPATH_KERNELS_FINE", "all")
    monkeypatch.setenv("TOKENPATH_KERNELS_EXACT", "0")
    monkeypatch.setenv("TOKENPATH_KERNELS_ISA", "auto")
    native = NativeSteps(tiny_llama, "float32", num_blocks=4, max_len=64, kernels_isa="avx2", kernels_fine=0b101,
                         kernels_exact=0b100).runner.native
    assert native is not None
    assert (native.isa, native.fine, native.exact) == (K.ISA_AVX2, 0b001, 0b100)  # exact wins over fine
    defaults = NativeSteps(tiny_llama, "float32", num_blocks=4, max_len=64, kernels_fine=None,
                           kernels_exact=None).runner.native
    assert defaults is not None and (defaults.fine, defaults.exact) == (0b11111, 0)
