"""The Timeline's side channel is declared: every key written to or read from `Timeline.attrs` in
src is one of `telemetry.timeline.ATTRS`, and every declared key has a writer.

Found by parsing src (not by grepping): a write is `<x>.attrs[KEY] = ...`, `<x>.attrs.update(KEY=...)`,
`<x>.attrs.setdefault(KEY, ...)` or a keyword of `<x>.stamp(EVENT, KEY=...)` (its extra keywords
go to attrs); a read is `<x>.attrs[KEY]` or `<x>.attrs.get(KEY)`, also through a local alias
(`a = rec.timeline.attrs`). replica/events.py writes the engine's facts from one tuple of
(key, value) pairs, read here as the stage test reads its events.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tokenpath.telemetry.timeline import ATTRS, Timeline

SRC = Path(__file__).resolve().parents[2] / "src" / "tokenpath"


def _is_attrs(node: ast.AST, aliases: set[str]) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "attrs") or (
        isinstance(node, ast.Name) and node.id in aliases)


def _const(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _aliases(tree: ast.AST) -> set[str]:
    """Local names bound to some `<x>.attrs` (`a = rec.timeline.attrs`, `t, a = ..., ....attrs`)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = zip(target.elts, node.value.elts, strict=False) if isinstance(target, ast.Tuple) and \
                isinstance(node.value, ast.Tuple) else [(target, node.value)]
            out |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _is_attrs(v, set())}
    return out


def uses() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(writes, reads): key -> the src files that write / read it."""
    writes: dict[str, set[str]] = {}
    reads: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases, name = _aliases(tree), str(path.relative_to(SRC))
        for node in ast.walk(tree):
            wrote: list[str | None] = []
            read: list[str | None] = []
            if isinstance(node, ast.Subscript) and _is_attrs(node.value, aliases):
                (wrote if isinstance(node.ctx, ast.Store) else read).append(_const(node.slice))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f = node.func
                if f.attr == "update" and _is_attrs(f.value, aliases):
                    wrote += [k.arg for k in node.keywords]
                elif f.attr == "setdefault" and _is_attrs(f.value, aliases) and node.args:
                    wrote.append(_const(node.args[0]))
                elif f.attr == "get" and _is_attrs(f.value, aliases) and node.args:
                    read.append(_const(node.args[0]))
                elif f.attr == "stamp":
                    wrote += [k.arg for k in node.keywords if k.arg != "at"]
            for table, keys in ((writes, wrote), (reads, read)):
                for key in keys:
                    if key is not None:
                        table.setdefault(key, set()).add(name)
    events = (SRC / "replica" / "events.py").read_text()
    loop = re.search(r"for key, value in \((.*?)\):\n", events, re.S)
    assert loop, "replica/events.py writes the engine's facts from one tuple"
    for key in re.findall(r"\(\"([a-z_]+)\", ", loop.group(1)):
        writes.setdefault(key, set()).add("replica/events.py")
    return writes, reads


def test_every_key_written_or_read_in_src_is_declared():
    writes, reads = uses()
    assert {k: sorted(v) for k, v in writes.items() if k not in ATTRS} == {}, "written, not in timeline.ATTRS"
    assert {k: sorted(v) for k, v in reads.items() if k not in ATTRS} == {}, "read, not in timeline.ATTRS"


def test_every_declared_key_has_a_writer():
    writes, _ = uses()
    assert sorted(set(ATTRS) - set(writes)) == [], "declared in timeline.ATTRS, written nowhere"


def test_the_scan_sees_each_kind_of_write():
    """The parser is not blind: a write of each form, in a file of its own, is found (a scan that
    found nothing would pass the tests above)."""
    writes, reads = uses()
    assert "admission/controller.py" in writes["queued_s"]  # a stamp keyword
    assert "routing/models.py" in writes["retry_reason"]  # attrs.update
    assert "admission/controller.py" in writes["admission_freed_by"]  # attrs.setdefault
    assert "replica/events.py" in writes["engine_stalls"]  # the events tuple
    assert "telemetry/causes.py" in reads["retry_lost_s"]  # a read through an alias
    t = Timeline("r")
    t.stamp("admitted", admission="queued")
    assert t.attrs == {"admission": "queued"}  # (a stamp's keywords are attrs)
