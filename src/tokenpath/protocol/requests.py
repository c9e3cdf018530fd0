"""`GenerateRequest`: one prompt's request, as it goes from the gateway to an engine.

Built once by the API layer (already validated and tokenized) and passed whole through
admission, routing and the replica to `EngineCore.add_request`; across the engine link its wire
fields are serialized as they are. The `timeline` is the gateway's per-request record: it never
crosses a process boundary (the replica boundary stamps engine events onto it, see
`tokenpath.replica.events`), so the engine never touches it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.telemetry.timeline import Timeline


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeline: Timeline | None = field(default=None, repr=False, compare=False)  # gateway-local
    priority: int = 0  # lower is more urgent; the engine schedules and preempts by it
    tenant: str = "anonymous"
    session_id: str | None = None
    # Monotonic seconds in the sender's clock. Across the link the client rewrites it as seconds
    # *remaining* (`deadline_in`), so the engine needs no shared clock to honour it.
    deadline: float | None = None
    traceparent: str | None = None  # W3C trace context of the gateway's span
    # GenAI semconv's operation name (chat, text_completion): the engine's own span says which API
    # call it served, which it cannot tell from token ids.
    operation: str | None = None
    arrival: float = field(default_factory=time.monotonic)  # monotonic, sender's clock
    prompt: str | None = field(default=None, repr=False)  # the text, when there was one (offline use)
