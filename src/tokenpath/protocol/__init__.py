"""The shared vocabulary of the request path: what crosses every boundary, in-process or not.

Every layer imports it; it imports nothing above it (stdlib, `tokenpath.errors`,
`tokenpath.telemetry.timeline` only). The engine link serializes exactly these types.

- `SamplingParams` (`sampling_params.py`): how to sample, validated once at the edge;
- `GenerateRequest` (`requests.py`): one prompt's request to an engine, and `Routable`: what a
  replica picker reads;
- `Submission` (`submission.py`): a request of either kind as the gateway holds it, with the
  gateway's own Timeline, prompt text and session id (what a picker reads; never sent to an engine);
- `RequestOutput` deltas with `EngineEvents` (`outputs.py`): what an engine hands back;
- `EmbeddingRequest`, `EmbeddingOutput` (`embeddings.py`): the same trip for an embedding model;
- `EngineState`, `ReplicaState` (`outputs.py`, `replica_state.py`): what routers read;
- `names.py`: the safe set for names and paths clients and operators give (checked at each edge);
- the engine link's own messages (`link.py`: hello/welcome, ping/pong, abort, reset, errors);
- `wire.py`: the engine link's one codec, for every message above that crosses a process;
- `openai_wire.py`: the outward codec, a request as an OpenAI-compatible backend's body (a URL
  replica: vLLM, SGLang, llama.cpp), every field mapped or refused by name.
"""

from tokenpath.protocol.embeddings import EmbeddingOutput, EmbeddingRequest
from tokenpath.protocol.outputs import (
           CompletionOutput,
           EngineEvents,
           EngineState,
           RequestOutput,
           TokenLogprob,
)
from tokenpath.protocol.replica_state import ReplicaState
from tokenpath.protocol.requests import GenerateRequest, Routable
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.protocol.submission import Submission

__all__ = ["CompletionOutput", "EmbeddingOutput", "EmbeddingRequest", "EngineEvents", "EngineState", "GenerateRequest", "ReplicaState",
           "RequestOutput", "Routable", "SamplingParams", "Submission", "TokenLogprob"]
