"""Settings declared once as dataclasses whose fields carry their checks, validated without pydantic.

`EngineConfig` and `SpeculativeConfig` (tokenpath.config) are what the engine runs with. The engine
path (`LLM(...)`, an engine process) must not need pydantic: its import and first model cost ~16
MiB of the offline engine's peak RSS (issue 42: memory at llama.cpp's level), and the engine only
reads typed attributes. So they are plain dataclasses, each field declared with `knob(...)`: its
default, its description (the flag's help) and its bounds, and `Settings.__post_init__` checks every
field against its annotation once, at construction, with an error naming the field. The pydantic
edges (the server's YAML `ServerConfig`, the engine link's codec) take them through `coerce` and
`as_dict`, so one declaration serves `LLM(...)` keywords, flags, YAML and the link alike.

The annotations this checks are the ones these settings use: bool, int, float, str, `Literal[...]`,
unions of those with None, and a nested `Settings` class (given as an instance, a mapping, or its
JSON text, as a flag gives it).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal


@dataclasses.dataclass(frozen=True)
class KnobInfo:
    """One field as flags and `--help` read it: pydantic's `FieldInfo` attributes of the same names
    (annotation, description, metadata, get_default), so `add_model_flags` reads either."""

    annotation: Any
    description: str | None
    metadata: tuple[Any, ...]
    default: Any
    default_factory: Callable[[], Any] | None

    def get_default(self, call_default_factory: bool = False) -> Any:  # noqa: ANN401 - any field's value
        if self.default_factory is not None:
            return self.default_factory() if call_default_factory else None
        return self.default


def knob(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,  # noqa: ANN401
         description: str | None = None, ge: float | None = None, le: float | None = None,
         gt: float | None = None, flag: Any = None) -> Any:  # noqa: ANN401 - a dataclass field
    """A field: its default (or `factory`, called per instance), its help text, its bounds, and a
    `tokenpath.config.Flag` where its flag differs from the plain one."""
    meta = {"description": description, "ge": ge, "le": le, "gt": gt, "flag": flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _hints(cls: type[Settings]) -> dict[str, Any]:
    """The class's resolved annotations (its module uses `from __future__ import annotations`),
    resolved once per class, on first use."""
    hints = cls.__dict__.get("_field_hints")
    if hints is None:
        hints = typing.get_type_hints(cls)
        cls._field_hints = hints
    return hints


class Settings:
    """Base of the settings dataclasses: checks each field at construction (frozen or not)."""

    _field_hints: typing.ClassVar[dict[str, Any] | None] = None

    def __post_init__(self) -> None:
        cls = type(self)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = _check(_hints(cls)[f.name], getattr(self, f.name), f"{cls.__name__}.{f.name}")
            _bounds(f, value, f"{cls.__name__}.{f.name}")
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Checks across fields, after each field's own; raise ValueError naming the field."""

    @classmethod
    def fields(cls) -> dict[str, KnobInfo]:
        """Each field's annotation, description, flag metadata and default, by name."""
        hints = _hints(cls)
        return {f.name: KnobInfo(hints[f.name], f.metadata.get("description"),
                                 tuple(m for m in (f.metadata.get("flag"),) if m is not None), f.default,
                                 None if f.default_factory is dataclasses.MISSING else f.default_factory)
                for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def coerce(cls, value: object) -> Any:  # noqa: ANN401 - an instance of cls
        """`value` as an instance: itself, or one built from a mapping (unknown keys are an error
        naming them, a ValueError as every other problem, so a pydantic edge reports it as its own)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{cls.__name__}: not a JSON object: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"{cls.__name__}: expected a mapping of settings, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown setting(s) {', '.join(map(str, unknown))}")
        try:
            return cls(**value)
        except TypeError as exc:  # a required field missing
            raise ValueError(f"{cls.__name__}: {exc}") from None

    def as_dict(self, exclude_defaults: bool = False, exclude: Collection[str] = ()) -> dict[str, Any]:
        """The fields as plain (JSON-safe) values, a nested config as its own dict; with
        `exclude_defaults`, only those that differ from a default instance's."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name in exclude or (exclude_defaults and value == _default(f)):
                continue
            out[f.name] = value.as_dict() if isinstance(value, Settings) else value
        return out

    def replace(self, **update: Any) -> Any:  # noqa: ANN401 - a copy of self, checked again
        return dataclasses.replace(self, **update)  # type: ignore[type-var]


def _default(f: dataclasses.Field) -> Any:  # noqa: ANN401 - any field's value
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def is_settings(t: object) -> bool:
    """Whether `t` is a Settings class (the engine link's codec carries these as their dicts)."""
    return isinstance(t, type) and issubclass(t, Settings)


def _check(hint: Any, value: Any, where: str) -> Any:  # noqa: ANN401 - any field's value
    """`value` checked against `hint`, possibly converted (an int for a float, a mapping or JSON
    text for a nested Settings); ValueError naming `where` when it does not fit."""
    if typing.get_origin(hint) is Literal:
        if value in typing.get_args(hint) and type(value) is type(typing.get_args(hint)[0]):
            return value
        raise ValueError(f"{where}: expected one of {', '.join(map(repr, typing.get_args(hint)))}, got {value!r}")
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        nested = [a for a in args if is_settings(a)]
        if nested and isinstance(value, str) and not value.strip():
            return None if type(None) in args else _check(nested[0], value, where)
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _check(a, value, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {hint}")
    if is_settings(hint):
        try:
            return hint.coerce(value)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # (YAML's 4.0, as pydantic took it)
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{where}: the annotation {hint} is not one Settings checks")
    raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")


def _bounds(f: dataclasses.Field, value: Any, where: str) -> None:  # noqa: ANN401
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    ge, le, gt = f.metadata.get("ge"), f.metadata.get("le"), f.metadata.get("gt")
    if ge is not None and value < ge:
        raise ValueError(f"{where}: {value} is below its minimum {ge}")
    if le is not None and value > le:
        raise ValueError(f"{where}: {value} is above its maximum {le}")
    if gt is not None and value <= gt:
        raise ValueError(f"{where}: {value} must be above {gt}")
