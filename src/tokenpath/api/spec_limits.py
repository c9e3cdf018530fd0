"""Cheap structural limits on a constraint spec, checked on the event loop before anything costly.

JSON-schema meta-validation and the grammar compile run in a worker process (api/grammar_worker.py),
but a spec that is plainly too big should never get that far: these checks are linear in the spec
and bounded, cheapest first. A schema's nesting depth is walked iteratively (jsonschema and the
grammar compiler recurse and raised RecursionError, a 500, at ~100 levels), enums and patterns are
counted and measured, and each regex (a `pattern`, a `patternProperties` key, `guided_regex`) has
its bounded repetitions multiplied out: `(a{1000}){2000}` asks for two million characters, and the
grammar compiler spends seconds expanding it.
"""

from __future__ import annotations

import re
from typing import Any

from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import (
    ENUM,
    ENUM_TOTAL,
    PATTERN_CHARS,
    REGEX_REPEAT,
    SCHEMA_DEPTH,
    SCHEMA_NODES,
)

_COUNT = re.compile(r"\{(\d{1,9})(?:,(\d{0,9}))?\}")


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def check_json_shape(value: Any, param: str) -> None:
    """Depth, size, enums and regexes of a JSON value (a schema), without recursion."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    nodes = enums = 0
    while stack:
        node, depth, key = stack.pop()
        nodes += 1
        if depth > SCHEMA_DEPTH.value:
            raise _bad(param, f"{param} is nested more than {SCHEMA_DEPTH.value} levels deep; send a flatter schema")
        if nodes > SCHEMA_NODES.value:
            raise _bad(param, f"{param} has more than {SCHEMA_NODES.value} values; send a smaller schema")
        if isinstance(node, dict):
            for k, v in node.items():
                if key == "patternProperties":
                    check_regex(k, f"{param} (a patternProperties key)")
                stack.append((v, depth + 1, k))
            enum = node.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
                if len(enum) > ENUM.value:
                    raise _bad(param, f"{param} has an enum of {len(enum)} entries, over the limit of {ENUM.value}")
                if enums > ENUM_TOTAL.value:
                    raise _bad(param, f"{param} has more than {ENUM_TOTAL.value} enum entries in all")
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_regex(pattern, f"{param} (a pattern)")
        elif isinstance(node, list):
            stack.extend((v, depth + 1, "") for v in node)


def check_regex(pattern: str, param: str) -> None:
    """Length, then the product of nested bounded repetitions (`{m}`, `{m,n}`, `{m,}`)."""
    if len(pattern) > PATTERN_CHARS.value:
        raise _bad(param, f"{param} is a regex of {len(pattern)} characters, over the limit of {PATTERN_CHARS.value}")
    if _repeat_weight(pattern) > REGEX_REPEAT.value:
        raise _bad(param, f"{param} repeats too much: its bounded repetitions multiply out to over {REGEX_REPEAT.value} "
                   "characters; use smaller counts")


def _repeat_weight(pattern: str) -> int:
    """An upper bound of the characters a regex's counted repetitions spell out: each atom weighs 1,
    a group the sum of its atoms (alternatives summed too: an over-estimate), a `{m,n}` multiplies the
    atom before it by max(m, n). `*` and `+` count once: they cost the compiler nothing to expand."""
    groups: list[tuple[int, int]] = []  # (weight so far, weight of the last atom) of each open group
    total, last = 0, 0
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            total, last, i = total + 1, 1, i + 2
            continue
        if ch == "[":  # a class is one atom; skip to its closing bracket
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            total, last, i = total + 1, 1, j + 1
            continue
        if ch == "(":
            groups.append((total, last))
            total, last, i = 0, 0, i + 1
            continue
        if ch == ")" and groups:
            inner = total
            total, last = groups.pop()
            total, last, i = total + inner, inner, i + 1
            continue
        if ch == "{":
            m = _COUNT.match(pattern, i)
            if m is not None:
                lo, hi = int(m.group(1)), m.group(2)
                times = max(lo, int(hi) if hi else 0)
                total += last * (times - 1) if times > 0 else -last
                last = last * times
                if total > REGEX_REPEAT.value:
                    return total
                i = m.end()
                continue
        total, last, i = total + 1, 1, i + 1
    return total + sum(g[0] for g in groups)
