"""The safe set for names and paths that clients and operators give: one check, used at each edge.

A name here (a LoRA adapter's, a model's or alias's, a tenant's) ends up in `/v1/models`, error
messages, log lines, the audit log, metric labels, the startup banner and the engine's adapter
cache key (`name\\0path`). So a name must be printable text: no C0/C1 control characters (NUL
included: it would also split that cache key), no bidirectional controls (U+202A-U+202E,
U+2066-U+2069, U+200E/U+200F, U+061C: a right-to-left override makes `evil\\u202etxt.exe` show
as another name in a terminal or a dashboard), nothing `str.isprintable()` refuses (line and
paragraph separators, unassigned code points), no leading or trailing whitespace, and at most
`limits.NAME_CHARS` characters.

Path separators are refused per kind, since what a name is used as differs:

- an adapter name (`lora_name`, `--lora-modules NAME=`) is a bare label chosen by whoever
  registers it; it travels next to a filesystem path in every `LoraRef`, and `../../x` there reads
  as a path in every listing. vLLM users name adapters `sql-lora`, so '/' and '\\\\' are refused;
- a model name (the request's `model`, `--served-model-name`, config aliases) keeps '/': Hugging
  Face ids such as `meta-llama/Llama-3.1-8B-Instruct` are what clients send and what vLLM serves
  under by default. A '\\\\' is in no such id and is refused;
- a tenant name (`tokenpath keys create --tenant`) keeps '/' as well (`acme/research` is a
  natural team name; tenants are labels in the store, never paths), and refuses '\\\\'.

A path (`lora_path`, `--lora-modules ...=PATH`) may hold any printable character a filesystem
allows, but not NUL (the OS cannot take it: Python raises ValueError, which was a 500), other
control characters or bidi controls (the path is shown in `/v1/models` and the banner), and is at
most `limits.PATH_CHARS` long.

The checks return the problem as text (`name_problem`, `path_problem`) so the API's schema can
raise its own validation error, and `check_name` / `check_path` raise `InvalidRequestError`
naming the parameter for everything else (the LoRA routes, the CLI's start-up checks).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import NAME_CHARS, PATH_CHARS

BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


@dataclass(frozen=True)
class NameKind:
    """What a name names, and so which characters beyond the common safe set it may not hold."""

    label: str  # in messages: "an adapter name"
    separators: str  # the path separators this kind refuses


ADAPTER = NameKind("a LoRA adapter name", "/\\")
MODEL = NameKind("a model name", "\\")
TENANT = NameKind("a tenant name", "\\")


def _describe(ch: str) -> str:
    """`U+202E (RIGHT-TO-LEFT OVERRIDE)`: a character named without printing it."""
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X}" + (f" ({name})" if name else "")


def _bad_char(value: str) -> tuple[int, str] | None:
    """(index, why) of the first character no name or path may hold."""
    for i, ch in enumerate(value):
        if ch in BIDI_CONTROLS:
            return i, f"the bidirectional control {_describe(ch)}"
        if unicodedata.category(ch) == "Cc":
            return i, f"the control character {_describe(ch)}"
    return None


def name_problem(value: str, kind: NameKind) -> str | None:
    """Why `value` is not a safe name of this kind (a sentence to show), or None when it is."""
    if not value:
        return f"{kind.label} must not be empty"
    if len(value) > NAME_CHARS.value:
        return f"{kind.label} must be at most {NAME_CHARS.value} characters (got {len(value)})"
    bad = _bad_char(value)
    if bad is not None:
        return f"{kind.label} must be printable text; it has {bad[1]} at position {bad[0]}"
    for i, ch in enumerate(value):
        if ch in kind.separators:
            return f"{kind.label} must not contain '{ch}' (at position {i}): it is a name, not a path"
        if not ch.isprintable() and ch != " ":
            return f"{kind.label} must be printable text; it has {_describe(ch)} at position {i}"
    if value != value.strip():
        return f"{kind.label} must not begin or end with whitespace"
    return None


def path_problem(value: str) -> str | None:
    """Why `value` cannot be a path given to the server (a sentence to show), or None."""
    if not value:
        return "a path must not be empty"
    if len(value) > PATH_CHARS.value:
        return f"a path must be at most {PATH_CHARS.value} characters (got {len(value)})"
    bad = _bad_char(value)
    if bad is not None:
        return f"a path must not contain {bad[1]} (at position {bad[0]})"
    return None


def check_name(value: str, kind: NameKind, param: str) -> str:
    """`value`, or InvalidRequestError (400) naming `param` when it is not a safe name."""
    problem = name_problem(value, kind)
    if problem is not None:
        raise InvalidRequestError(f"{param}: {problem}", param=param, code="invalid_name")
    return value


def check_path(value: str, param: str) -> str:
    """`value`, or InvalidRequestError (400) naming `param` when no path can hold it."""
    problem = path_problem(value)
    if problem is not None:
        raise InvalidRequestError(f"{param}: {problem}", param=param, code="invalid_path")
    return value
