"""`LoraRef`: which LoRA adapter a request runs with, as it travels to an engine.

The request carries the adapter's name *and* its path, so any engine (in-process, an engine
process, a Ray actor) can load it on first use without a registry of its own: the gateway's
registry (`routing.models.ModelRouter`) is the only one, and `/v1/load_lora_adapter` changes it
in one place. The name is what clients send as `model`; the path is what the engine reads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRef:
    name: str  # what clients send as `model` (and what /v1/models lists)
    path: str  # a PEFT directory: adapter_config.json + adapter_model.safetensors
    base: str = ""  # the deployment it runs on (gateway-side; not needed by the engine)

    def wire(self) -> list[str]:
        return [self.name, self.path]

    @classmethod
    def from_wire(cls, value: object) -> LoraRef | None:
        if not value:
            return None
        if not isinstance(value, (list, tuple)) or len(value) < 2:
            raise ValueError(f"lora must be [name, path], got {value!r}")
        return cls(name=str(value[0]), path=str(value[1]))
