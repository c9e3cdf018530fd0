"""Dataclasses as positional rows: the engine link's hot layouts, declared by the types themselves.

An `out` frame (a request's output delta: one per request per engine step) carries its choices,
their token logprobs, its engine events and its grammar stats as msgpack arrays, not maps, so no
key names travel per token. The layout of each array is its dataclass's field order
(`TokenLogprob`, `CompletionOutput`, `EngineEvents`, `GrammarStats`): `to_row` and `from_row`
derive both directions from that one declaration, so the encoder and the decoder cannot drift (vLLM
declares its hot messages the same way, as msgspec `array_like` structs). Nested rows, tuples and
copies follow each field's type hint, planned once per class at import.

The order is a wire contract, pinned by tests/replica/test_link_rows.py: a field is only ever
appended, with a default. A row from a peer of an older version, which knows fewer fields, is
read with the missing trailing fields at their defaults, and a newer peer's extra trailing fields
are ignored. (Rows are sent whole: leaving trailing defaults off cost more per frame, in Python,
than the bytes it saved.)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from tokenpath.protocol.outputs import CompletionOutput, EngineEvents, GrammarStats, TokenLogprob

ROW_TYPES: tuple[type, ...] = (TokenLogprob, CompletionOutput, EngineEvents, GrammarStats)
_REQUIRED = object()  # (the default of a field without one)


def _exprs(hint: Any, enc: str, dec: str) -> tuple[str, str]:
    """(encode, decode) expressions of one field, over the source expressions `enc` (the object's
    attribute) and `dec` (the row's element): nested rows, lists copied (the engine appends to its
    event lists in place: what was sent must not change under the sender), tuples rebuilt on the
    way in (msgpack has only arrays)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        e, d = _exprs(args[0], enc, dec)
        return (e if e == enc else f"(None if {enc} is None else {e})",
                d if d == dec else f"(None if {dec} is None else {d})")
    if hint in ROW_TYPES:
        return f"_enc_{hint.__name__}({enc})", f"_dec_{hint.__name__}({dec})"
    if hint is list or typing.get_origin(hint) is list:
        item = (typing.get_args(hint) or (Any,))[0]
        if item in ROW_TYPES:
            return f"[_enc_{item.__name__}(x) for x in {enc}]", f"[_dec_{item.__name__}(x) for x in {dec}]"
        if typing.get_origin(item) is tuple:
            return f"[list(x) for x in {enc}]", f"[tuple(x) for x in {dec}]"
        if item is list or typing.get_origin(item) is list:
            return f"[list(x) for x in {enc}]", f"[list(x) for x in {dec}]"
        return f"list({enc})", f"_list({dec})"
    return enc, dec


def _list(v: Any) -> list:
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"expected an array, got {type(v).__name__}")
    return list(v)


def _source(cls: type) -> tuple[str, list[object]]:
    """The encoder and decoder of one class, as Python source (compiled once, at import: a frame
    per request per engine step goes through them, so they are as fast as hand-written ones), and
    its fields' defaults in row order."""
    hints, name = typing.get_type_hints(cls), cls.__name__
    enc, dec, defaults = [], [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        e, d = _exprs(hints[f.name], f"o.{f.name}", f"r[{i}]")
        enc.append(e)
        dec.append(d)
        defaults.append(f.default if f.default is not dataclasses.MISSING else
                        f.default_factory() if f.default_factory is not dataclasses.MISSING else _REQUIRED)
    required = sum(d is _REQUIRED for d in defaults)
    src = (f"def _enc_{name}(o):\n"
           f"    return [{', '.join(enc)}]\n"
           f"def _dec_{name}(r):\n"
           f"    if type(r) is not list:\n"
           f"        r = _list(r)\n"
           f"    n = len(r)\n"
           f"    if n != {len(dec)}:\n"
           f"        if n < {required}:\n"
           f"            raise TypeError('a {name} row of ' + str(n) + ' fields, fewer than its {required} required')\n"
           f"        r = r[:{len(dec)}] + _DEFAULTS_{name}[n:]\n"
           f"    return _cls_{name}({', '.join(dec)})\n")
    return src, defaults


def _compile() -> dict[str, Any]:
    scope: dict[str, Any] = {"_list": _list}
    for cls in ROW_TYPES:
        src, defaults = _source(cls)
        scope[f"_DEFAULTS_{cls.__name__}"] = defaults
        scope[f"_cls_{cls.__name__}"] = cls
        exec(compile(src, f"<rows of {cls.__name__}>", "exec"), scope)  # noqa: S102 (our own source)
    return scope


_SCOPE = _compile()
_ENCODERS: dict[type, Callable[[Any], list]] = {cls: _SCOPE[f"_enc_{cls.__name__}"] for cls in ROW_TYPES}
_DECODERS: dict[type, Callable[[Any], Any]] = {cls: _SCOPE[f"_dec_{cls.__name__}"] for cls in ROW_TYPES}


def to_row(obj: Any) -> list:
    """`obj`'s fields in declaration order."""
    return _ENCODERS[type(obj)](obj)


def from_row(cls: type, row: Any) -> Any:
    """The `cls` a row holds: missing trailing fields keep their defaults, extra ones are ignored;
    TypeError (or ValueError) for something that is not such a row."""
    return _DECODERS[cls](row)
