"""docs/architecture.md stays true of the code: every path it names exists, every package is in
its layout, its stage table is the code's, its layer order is the one import-linter enforces,
and its table of engine link messages is the codec's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tokenpath.protocol import link
from tokenpath.protocol.wire import FIELD_MESSAGES
from tokenpath.telemetry.timeline import STAGE_BOUNDS, STAGES

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "tokenpath"
DOC = (ROOT / "docs" / "architecture.md").read_text()
SUFFIXES = (".py", ".md", ".toml", ".h", ".cpp", ".html", ".yaml")


def section(name: str) -> str:
    m = re.search(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", DOC, re.S)
    assert m, f"docs/architecture.md lost its <!-- {name} --> block"
    return m.group(1)


def table_rows(text: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return rows[2:]  # past the header and its rule


def test_every_path_it_names_exists():
    named = {t for t in re.findall(r"`([^`\s]+)`", DOC)
             if not t.startswith("/") and re.fullmatch(r"[\w./-]+", t) and ("/" in t or t.endswith(SUFFIXES))}
    assert len(named) > 50  # (the check is looking at the doc's paths at all)
    missing = sorted(t for t in named if not (ROOT / t).exists() and not (PKG / t).exists())
    assert missing == [], missing


def test_every_package_and_top_module_is_in_the_layout():
    layout = {row[0].strip("`") for row in table_rows(DOC.split("## Layout", 1)[1].split("###", 1)[0])}
    packages = {f"{p.name}/" for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.name for p in PKG.glob("*.py") if p.name != "__init__.py"}
    assert packages | modules == layout


def test_the_stage_table_is_the_codes():
    rows = table_rows(section("stages"))
    assert [r[0].strip("`") for r in rows] == list(STAGES)
    bounds = {stage: f"{start} -> {end}" for stage, start, end in (*STAGE_BOUNDS, ("total", "received", "finished"))}
    assert {r[0].strip("`"): r[1] for r in rows} == bounds


def test_the_layer_order_is_the_one_import_linter_enforces():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    enforced = [{m.strip().removeprefix("tokenpath.") for m in layer.split("|")} for layer in contract["layers"]]
    documented = [{m.strip() for m in layer.split("|")} for layer in section("layers").strip().split(">")]
    assert documented == enforced


def test_the_message_table_is_the_codecs():
    rows = table_rows(section("messages"))
    frames = {f.strip("` ") for r in rows for f in r[0].split("/")}
    wire = (PKG / "protocol" / "wire.py").read_text()
    assert frames == set(FIELD_MESSAGES) | set(re.findall(r"\"t\": \"(\w+)\"", wire))
    classes = {c for r in rows for c in re.findall(r"`(\w+)`", r[1])}
    link_messages = {name for name, obj in vars(link).items() if isinstance(obj, type) and obj.__module__ == link.__name__}
    assert link_messages <= classes
    assert {cls.__name__ for cls in FIELD_MESSAGES.values()} <= classes
