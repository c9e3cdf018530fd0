"""What admission needs from a replica picker: the interface, not the policies.

The flow controller is handed a picker (by the deployment that owns it) and calls `pick` when a
replica has room; the policies themselves live above, in `tokenpath.routing.replicas`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenpath.protocol import ReplicaState, Routable


@dataclass(frozen=True)
class Pick:
    state: ReplicaState
    reason: str  # short, low-cardinality: "prefix_hit", "cold", "load_escape", "p2c", ...
    matched_blocks: int = 0
    # A replica that held more of this prompt and was passed over: {"replica", "blocks", "why"}
    # (the request's prefix_elsewhere cause).
    elsewhere: dict | None = None

    @property
    def name(self) -> str:
        return self.state.name


class ReplicaPicker(Protocol):
    policy: str

    def pick(self, request: Routable, states: Sequence[ReplicaState]) -> Pick: ...

    def forget(self, replica: str) -> None:
        """A replica left (ejected or removed): drop what the picker remembers about it."""
