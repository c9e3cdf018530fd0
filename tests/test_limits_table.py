"""The limits table (`tokenpath.protocol.limits`) stays the one home of every request cap.

- No module of src/ defines a module-level `MAX_*`/`MIN_*` (or `*_MAX_*`) constant of its own,
  except the internal bounds listed below (not a request's: frame sizes, retries, kernel shapes),
  each with why. A new request cap therefore fails here until it is an entry of the table.
- No request schema in api/ or protocol/ writes a cap as a literal in a pydantic `Field(...)`
  (`max_length=`, `le=`, `lt=`): it names the entry's value.
- `Caps`, the settings that change a cap, take their defaults and ranges from the entries.
- docs/limits.md is the table's `markdown()`, and README's `caps` list names every `caps.*` entry.

Each entry's enforcement (a request just over it is refused naming its param) is
tests/api/test_limits_enforced.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tokenpath.api.settings import ApiSettings, Caps
from tokenpath.config import parse_bytes
from tokenpath.protocol import limits

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tokenpath"
TABLE_MODULE = SRC / "protocol" / "limits.py"
CAP_NAME = re.compile(r"(^|_)(MAX|MIN)(_|$)")

# Module-level bounds that are not a request's caps, so not entries of the table.
INTERNAL = {
    "bench/runner.py:HARD_MAX_REQUESTS": "the bench CLI's own sanity bound on its --num-requests",
    "config.py:MAX_SPEC_TOKENS": "an engine setting's range (speculative tokens per step)",
    "engine/spec/suffix.py:MAX_GLOBAL_NODES": "the suffix proposer's shared trie, per generation (its memory bound)",
    "engine/spec/suffix.py:MAX_OWN_PROMPT": "how much of a prompt the suffix proposer indexes (its stall bound)",
    "engine/spec/suffix.py:MIN_MATCH": "the shortest match the suffix proposer drafts from (measured, not a cap)",
    "engine/spec/cost.py:MAX_ROWS": "the largest decode step whose time the cost draft policy keeps (its memory bound)",
    "engine/core.py:MAX_CONTEXT_DEFAULT": "the engine's default context when a model names none",
    "engine/kernels/model.py:MAX_PARTS": "a kernel's layout (csrc/forward.cpp kMaxParts)",
    "engine/lora_batch.py:MAX_NATIVE_RANK": "a kernel's bound on LoRA rank (kLoraMaxRank)",
    "engine/tokenizer_bpe_spec.py:MIN_VOCAB": "the vocabulary size from which the compact BPE is used (a memory choice, not a cap)",
    "engine/spec/state.py:MAX_PAUSE": "speculative decoding's internal back-off",
    "gateway/audit_writer.py:RETRY_MAX_S": "the audit store's retry backoff",
    "gateway/audit_writer.py:WAIT_MAX_S": "the audit store's write wait",
    "gateway/keys_listener.py:RETRY_MAX_S": "the PostgreSQL keys listener's reconnect backoff",
    "protocol/outputs.py:MAX_STALLS": "stall records kept per request (an output's size, not an input's)",
    "protocol/wire.py:MAX_FRAME": "the engine link's frame bound (between processes, not from clients)",
    "protocol/sampling_params.py:MIN_REPETITION_PENALTY": "a float range the sampler can compute, not a size",
    "replica/link_server.py:HELLO_MAX_BYTES": "the engine link's hello",
    "replica/liveness.py:MAX_TICK_S": "the liveness timer",
    "replica/liveness.py:MAX_SLEEP_S": "the liveness timer",
    "replica/local.py:RESTART_MAX_S": "a replica's restart backoff",
    "replica/processes.py:RESTART_MAX_S": "an engine process's restart backoff",
    "replica/processes.py:LOG_MAX_BYTES": "an engine process's log file",
    "routing/models.py:MAX_ATTEMPTS": "the router's retries on another replica",
    "telemetry/causes.py:SPEC_MAX_ACCEPTANCE": "a cause's threshold",
    "telemetry/causes.py:SPEC_MIN_PROPOSED": "a cause's threshold",
    "telemetry/causes.py:MIN_MS": "a cause's threshold",
    "telemetry/causes.py:CLIENT_MIN_MS": "a cause's threshold",
    "telemetry/thrash.py:MIN_RELOADS": "a cause's threshold",
    "server/memory.py:M_ARENA_MAX": "glibc's mallopt parameter number",
    "server/memory.py:ARENA_MAX": "the process's malloc arenas",
}


def _module_constants(path: Path) -> list[tuple[str, int]]:
    names: list[tuple[str, int]] = []
    for node in ast.parse(path.read_text()).body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Name):
                    names.append((t.id, node.lineno))
    return names


def cap_constants_outside_the_table(src: Path) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        if path == src / "protocol" / "limits.py":
            continue
        rel = path.relative_to(src).as_posix()
        for name, line in _module_constants(path):
            if CAP_NAME.search(name) and f"{rel}:{name}" not in INTERNAL:
                found.append(f"{rel}:{line} {name}")
    return found


def _literal_number(node: ast.expr) -> float | None:
    """The value of a number written out (`4096`, `64 * 1024`, `-(2**63)`), None for anything named."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        if isinstance(node, ast.BinOp | ast.UnaryOp) and all(
                isinstance(n, ast.Constant | ast.BinOp | ast.UnaryOp | ast.operator | ast.unaryop)
                for n in ast.walk(node)):
            return float(eval(compile(ast.Expression(node), "<cap>", "eval")))  # numbers and operators only
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def literal_field_caps(paths: list[Path], root: Path = SRC) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field"):
                continue
            for kw in node.keywords:
                value = _literal_number(kw.value) if kw.arg in ("max_length", "le", "lt") else None
                # (ranges of a value, temperature <= 2 or top_p <= 1, are not caps)
                if value is not None and abs(value) > 2:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {kw.arg}={value:g}")
    return found


def test_no_cap_constant_outside_the_table():
    found = cap_constants_outside_the_table(SRC)
    assert not found, ("request caps belong in src/tokenpath/protocol/limits.py (an entry of TABLE), or, for an "
                       f"internal bound, in this test's INTERNAL with why: {found}")


def test_the_allowlist_has_no_stale_names():
    present = {f"{path.relative_to(SRC).as_posix()}:{name}" for path in SRC.rglob("*.py")
               for name, _ in _module_constants(path)}
    assert set(INTERNAL) <= present, set(INTERNAL) - present


def test_the_scan_finds_a_cap_written_outside_the_table(tmp_path):
    """The check can fail: a module with its own MAX_* is found, by name and line."""
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "new.py").write_text('"""x"""\n\nMAX_WIDGETS = 12\nFOO, MIN_BAR = 1, 2\n')
    assert cap_constants_outside_the_table(tmp_path) == ["api/new.py:3 MAX_WIDGETS", "api/new.py:4 MIN_BAR"]


def test_no_request_schema_writes_a_cap_as_a_literal():
    schemas = sorted((SRC / "api").rglob("*.py")) + sorted((SRC / "protocol").rglob("*.py"))
    assert not literal_field_caps(schemas), literal_field_caps(schemas)


def test_the_literal_scan_can_fail(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from pydantic import Field\nx = Field(max_length=4096)\ny = Field(le=64 * 1024)\n"
                    "z = Field(le=2)\nw = Field(max_length=LIMIT.value)\n")
    assert literal_field_caps([path], tmp_path) == ["probe.py:2 max_length=4096", "probe.py:3 le=65536"]


def test_the_table_is_well_formed():
    names = [lim.name for lim in limits.TABLE]
    assert len(names) == len(set(names))
    declared = [v for v in vars(limits).values() if isinstance(v, limits.Limit)]
    assert len(declared) == len(limits.TABLE) and set(map(id, declared)) == set(map(id, limits.TABLE)), \
        "every module-level Limit is in TABLE"
    for lim in limits.TABLE:
        assert lim.least < lim.value, lim
        if lim.setting_least is not None:
            assert lim.setting_least <= lim.value, lim
        if lim.setting_most is not None:
            assert lim.value <= lim.setting_most, lim


def test_settings_take_their_defaults_and_ranges_from_the_table():
    caps, settings = Caps(), ApiSettings()
    for lim in limits.TABLE:
        if lim.setting is None:
            continue
        if lim.setting.startswith("caps."):
            field = lim.setting.removeprefix("caps.")
            assert getattr(caps, field) == lim.value, lim
            meta = Caps.model_fields[field].metadata
            ge = next((m.ge for m in meta if hasattr(m, "ge")), None)
            le = next((m.le for m in meta if hasattr(m, "le")), None)
            assert (ge, le) == (lim.setting_least, lim.setting_most), (lim, meta)
        else:
            value = getattr(settings, lim.setting)
            assert (parse_bytes(value) if isinstance(value, str) else value) == lim.value, lim
    # What the engine accepts is the most an operator may set the API's caps to.
    assert limits.ENGINE_N.value == limits.N.setting_most
    assert limits.ENGINE_STOP.value == limits.STOP.setting_most


def test_docs_limits_is_the_table():
    doc = (ROOT / "docs" / "limits.md").read_text()
    assert doc == limits.markdown(), ("docs/limits.md is stale: regenerate it with "
                                      "`PYTHONPATH=src python -m tokenpath.protocol.limits > docs/limits.md`")


def test_readme_names_every_caps_setting_and_the_table():
    readme = (ROOT / "README.md").read_text()
    assert "docs/limits.md" in readme
    for lim in limits.TABLE:
        if lim.setting is not None:
            assert f"`{lim.setting.removeprefix('caps.')}`" in readme, lim.setting
    assert f"{limits.REQUEST_TOKENS.value:,} by default" in readme
