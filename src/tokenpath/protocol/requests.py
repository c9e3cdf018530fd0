"""`GenerateRequest`: one prompt's request, as an engine receives it.

Built once by the API layer (already validated and tokenized) and passed through admission,
routing and the replica to `EngineCore.add_request`; across the engine link its fields are
serialized as they are (`protocol.wire.encode_request`). It holds what an engine acts on and
nothing else: the gateway's own per-request state (its Timeline, the prompt text it echoes, the
session id its picker reads) travels beside it in a `protocol.submission.Submission`, which the
gateway keeps and an engine never sees.

`deadline` is enforced twice: by the gateway, in its queue and up to the first token
(`routing.models.Deployment`), and by the engine, which drops a request still waiting for its
first schedule once it has passed (`engine.scheduler.Scheduler.expired`), before it costs a
prefill. It crosses the link as seconds left (`deadline_in`) and is rebuilt in the engine's
clock on arrival: never earlier than the gateway's, since the transit only makes it later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import PRIORITY
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.sampling_params import SamplingParams

# Priorities are 32-bit signed integers (lower is more urgent; `limits.PRIORITY`). Every integer
# that crosses the engine link is range-checked before it leaves the gateway: a value the codec
# cannot carry (2**64 raised OverflowError while sending) was once taken for the replica's fault
# and ejected it.


def check_priority(value: int, param: str = "priority") -> int:
    """`value` if it is a priority in range, else a 400 naming `param`."""
    if isinstance(value, bool) or not isinstance(value, int) or not PRIORITY.least <= value <= PRIORITY.value:
        raise InvalidRequestError(f"{param} must be an integer between {PRIORITY.least} and {PRIORITY.value}, got {value!r}",
                                  param=param)
    return value


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is more urgent; the engine schedules and preempts by it
    tenant: str = "anonymous"
    # Monotonic seconds in the sender's clock. Across the link the client rewrites it as seconds
    # *remaining* (`deadline_in`), so the engine needs no shared clock to honour it.
    deadline: float | None = None
    traceparent: str | None = None  # W3C trace context of the gateway's span
    # GenAI semconv's operation name (chat, text_completion): the engine's own span says which API
    # call it served, which it cannot tell from token ids.
    operation: str | None = None
    arrival: float = field(default_factory=time.monotonic)  # monotonic, sender's clock
    lora: LoraRef | None = None  # the LoRA adapter to run with (None: the base model)
    # The running request whose slot this one takes (admission's share preemption,
    # `admission/preempt.py`): the engine pauses that one by recompute and runs this one first.
    # It rides on the request rather than in a message of its own, so the slot changes hands
    # when this request reaches the engine's queue: never before it is there to take it (a
    # grammar still compiling), and never for a request the engine never got. None: nobody's.
    preempts: str | None = None

    def __post_init__(self) -> None:
        check_priority(self.priority)  # (token ids: the API checks them against the vocabulary)


@runtime_checkable
class Routable(Protocol):
    """What a replica picker reads from a request, and all it may read.

    The prompt's token ids (the prefix-aware picker hashes them), the LoRA adapter (its blocks
    hash under the adapter's own root, and replicas that hold it are preferred) and the session id
    (session affinity). Generations and embeddings share one picker per deployment, and what a
    picker is handed is the gateway's `protocol.submission.Submission` of either kind: its ids and
    adapter come from the request (an embedding runs on the base model: its `lora` is always
    None), its session id is the gateway's own. So a picker never asks which kind it holds.
    Read-only properties, so a field, a slot and a computed property all satisfy it."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def lora(self) -> LoraRef | None: ...

    @property
    def session_id(self) -> str | None: ...
