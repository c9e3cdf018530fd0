"""`--lora-modules`: vLLM's two forms, `NAME=PATH` and the JSON object
`{"name": ..., "path": ..., "base_model_name": ...}`, registered like `/v1/load_lora_adapter`
(same checks) once the models are loaded, before the server binds: a bad adapter stops start-up
with the problem named, not a half-up server."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenpath.api.lora import register_adapter
from tokenpath.errors import InvalidRequestError
from tokenpath.routing.models import ModelRouter


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoraModule:
    text = value.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise InvalidRequestError(f"{value!r}: not valid JSON ({exc})", param="lora_modules") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise InvalidRequestError(f"{value!r}: the JSON form needs string 'name' and 'path'", param="lora_modules")
        unknown = set(d) - {"name", "path", "base_model_name"}
        if unknown:
            raise InvalidRequestError(f"{value!r}: unknown keys {sorted(unknown)}", param="lora_modules")
        base = d.get("base_model_name")
        return LoraModule(d["name"], d["path"], str(base) if base else None)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise InvalidRequestError(f"{value!r}: expected NAME=PATH or a JSON object", param="lora_modules")
    return LoraModule(name.strip(), path.strip())


async def register_lora_modules(router: ModelRouter, values: list[str]) -> None:
    for value in values:
        m = parse_lora_module(value)
        await register_adapter(router, m.name, m.path, m.base_model_name)
