"""The kernel interface is declared twice, once per side, and the two must agree: csrc/tp_api.h
for the compiler (every .cpp defining an exported function includes it, so a definition that
differs is a compile error) and kernels/abi.py SIGNATURES for ctypes, which checks nothing against
the C side. Here the header is parsed and compared with the table: the same functions, the same
number of arguments of the same kinds (int, float, pointer) and the same return kinds. Then the
built objects: each exports exactly the table's functions.

Also here: the forward's status. A step that walks more work phases than were allocated
(csrc/forward.cpp phases_for_step) must come back as an error, never overrun the array: a test
entry caps the phases to provoke it.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tokenpath.engine.kernels import abi
from tokenpath.engine.kernels.library import OBJECTS, PACKAGE_DIR, object_path

CSRC = PACKAGE_DIR / "csrc"
HEADER = CSRC / "tp_api.h"
DECL = re.compile(r"^[ \t]*([A-Za-z_][\w \t\*]*?[ \t\*])(tp_\w+)\s*\(([^)]*)\)\s*;", re.M)
# A definition at the start of a line: `int tp_repack(int wtype, ...) {` (possibly over lines).
DEFN = re.compile(r"^[A-Za-z_][\w \t\*]*?[ \t\*](tp_\w+)\s*\([^;{]*\)\s*\{", re.M)


def kind(c_type: str) -> type | None:
    """A C parameter or return type as the ctypes type the table must give it."""
    t = " ".join(c_type.replace("*", " * ").split())
    if "*" in t:
        return ctypes.c_void_p
    t = t.removeprefix("const ").strip()
    kinds = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int, "float": ctypes.c_float}
    if t not in kinds:
        raise AssertionError(f"tp_api.h uses type {c_type!r}: map it here (and in kernels/abi.py)")
    return kinds[t]


def param_kind(param: str) -> type | None:
    m = re.fullmatch(r"(.*?[\s\*])([A-Za-z_]\w*)", " ".join(param.split()))
    assert m, f"tp_api.h: name every parameter ({param!r})"
    return kind(m.group(1))


def parse_header(text: str) -> dict[str, tuple[type | None, list[type | None]]]:
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, tuple[type | None, list[type | None]]] = {}
    for ret, name, params in DECL.findall(text):
        params = params.strip()
        args = [] if params in ("", "void") else [param_kind(p) for p in params.split(",")]
        assert name not in out, f"{name} declared twice"
        out[name] = (kind(ret), args)
    return out


def mismatches(declared: dict, table: dict) -> list[str]:
    problems = [f"{n}: in csrc/tp_api.h, not in kernels/abi.py SIGNATURES" for n in declared.keys() - table.keys()]
    problems += [f"{n}: in kernels/abi.py SIGNATURES, not in csrc/tp_api.h" for n in table.keys() - declared.keys()]
    for name in declared.keys() & table.keys():
        (c_ret, c_args), (py_ret, py_args) = declared[name], table[name]
        if c_ret is not py_ret:
            problems.append(f"{name}: returns {c_ret} in C, {py_ret} in Python")
        if len(c_args) != len(py_args):
            problems.append(f"{name}: {len(c_args)} arguments in C, {len(py_args)} in Python")
        else:
            problems += [f"{name}: argument {i} is {c} in C, {p} in Python"
                         for i, (c, p) in enumerate(zip(c_args, py_args, strict=True)) if c is not p]
    return sorted(problems)


def test_the_header_and_the_ctypes_table_agree():
    declared = parse_header(HEADER.read_text())
    assert len(declared) >= 12  # (the parser is finding the declarations at all)
    assert mismatches(declared, abi.SIGNATURES) == []


def test_the_comparison_catches_a_change_on_either_side():
    declared = parse_header(HEADER.read_text())
    table = dict(abi.SIGNATURES)
    ret, args = table["tp_gemm"]
    assert mismatches(declared, {**table, "tp_gemm": (ret, args[:-1])}) == [
        "tp_gemm: 10 arguments in C, 9 in Python"]
    assert mismatches(declared, {**table, "tp_gemm": (ret, [ctypes.c_float, *args[1:]])}) == [
        f"tp_gemm: argument 0 is {ctypes.c_int} in C, {ctypes.c_float} in Python"]
    changed = HEADER.read_text().replace("void tp_model_free(void* handle);", "int tp_model_free(void* handle, int x);")
    assert mismatches(parse_header(changed), table) == [
        "tp_model_free: 2 arguments in C, 1 in Python", f"tp_model_free: returns {ctypes.c_int} in C, None in Python"]
    del table["tp_model_abi"]
    assert mismatches(declared, table) == ["tp_model_abi: in csrc/tp_api.h, not in kernels/abi.py SIGNATURES"]


def test_every_exported_definition_is_declared_in_the_header():
    """The header is the whole interface: each .cpp defining a tp_ function includes it (so the
    compiler checks the definition against it) and defines nothing the header lacks. A header may
    define some too (moe.h: tp_model_set_moe), included by a .cpp after tp_api.h."""
    declared = parse_header(HEADER.read_text())
    defined: set[str] = set()
    for src in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        names = set(DEFN.findall(re.sub(r"//[^\n]*", "", src.read_text())))
        if names and src.suffix == ".cpp":
            assert '#include "tp_api.h"' in src.read_text(), src.name
        defined |= names
    assert defined == set(declared)


def _built_objects() -> list[Path]:
    return [p for stem in OBJECTS.values() if (p := object_path(PACKAGE_DIR, stem))]


@pytest.mark.requires("nm", "kernels")
@pytest.mark.parametrize("path", _built_objects(), ids=lambda p: p.name.split(".")[0])
def test_each_built_object_exports_exactly_the_table(path):
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("tp_")}
    assert exported == set(abi.SIGNATURES)


def test_forward_status_is_checked():
    abi.check_forward(0)
    with pytest.raises(RuntimeError, match="work phases"):
        abi.check_forward(1)
    with pytest.raises(RuntimeError, match="unknown status 7"):
        abi.check_forward(7)


@pytest.mark.requires("kernels")
def test_a_step_with_too_few_phases_raises_instead_of_overrunning(tiny_native):
    """Capped below what a step walks, the forward skips the surplus phases on every thread (no
    write past the array, no thread left waiting) and returns TP_STATUS_PHASES, which the model
    raises; uncapped, the same model then computes the same logits as before."""
    native = tiny_native.runner.native
    table = [0, 1]
    before = tiny_native.step([(table, list(range(3, 20)), 0)])
    for cap in (1, 3, 3 + 16):  # the embedding only; one layer's first phases; all but the head
        native.lib.lib.tp_model_debug_phase_cap(native._handle, cap)
        with pytest.raises(RuntimeError, match="work phases"):
            tiny_native.step([(table, list(range(3, 20)), 0)])
    native.lib.lib.tp_model_debug_phase_cap(native._handle, 0)
    after = tiny_native.step([(table, list(range(3, 20)), 0)])
    assert np.array_equal(before.numpy(), after.numpy())
