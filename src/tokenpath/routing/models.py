"""Model routing: which deployment serves this model name?

A deployment is one served model name with a task (chat, completion, embedding) and one or more
replicas. Aliases map extra names onto a deployment; fallbacks name other deployments to try, in
order, when one is down or saturated. Admission, queueing and replica picking happen inside
`Deployment.generate` (see `tokenpath.admission` and `tokenpath.routing.replicas`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenpath.engine.outputs import RequestOutput
from tokenpath.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from tokenpath.replica.base import GenerateRequest, Replica

Task = Literal["chat", "completion", "embedding"]
# A chat deployment also serves /v1/completions (same engine, no chat template).
_SERVES: dict[str, set[str]] = {"chat": {"chat", "completion"}, "completion": {"completion"},
                                "embedding": {"embedding"}}


@dataclass
class Deployment:
    name: str
    task: Task
    replicas: list[Replica] = field(default_factory=list)
    tokenizer: Any = None  # tokenpath.engine.tokenizer.Tokenizer (chat/completion) or the embedder's
    max_model_len: int = 2048
    embedder: Any = None  # tokenpath.engine.embedding.EmbeddingEngine for task == "embedding"
    owned_by: str = "tokenpath"

    def serves(self, task: str) -> bool:
        return task in _SERVES[self.task]

    def healthy_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.state().healthy]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream deltas for one request. Closing the iterator aborts the request in its replica."""
        replicas = self.healthy_replicas()
        if not replicas:
            raise ServiceUnavailableError(f"no healthy replica for model '{self.name}'")
        replica = min(replicas, key=lambda r: (r.state().waiting, r.state().running))
        request.timeline.stamp("dispatched", replica=replica.name)
        async for out in replica.generate(request):
            yield out


class ModelRouter:
    def __init__(
        self,
        deployments: Sequence[Deployment],
        aliases: dict[str, str] | None = None,
        fallbacks: dict[str, list[str]] | None = None,
    ) -> None:
        self.deployments = {d.name: d for d in deployments}
        self.aliases = dict(aliases or {})
        self.fallbacks = {k: list(v) for k, v in (fallbacks or {}).items()}
        for alias, target in self.aliases.items():
            if target not in self.deployments:
                raise ValueError(f"alias '{alias}' points at unknown deployment '{target}'")

    def names(self) -> list[str]:
        return list(self.deployments)

    def resolve(self, model: str, task: str) -> Deployment:
        """Name (or alias) -> deployment; 404 for an unknown name, 400 when it cannot do the task."""
        name = self.aliases.get(model, model)
        dep = self.deployments.get(name)
        if dep is None:
            raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found")
        if not dep.serves(task):
            raise InvalidRequestError(
                f"The model '{model}' is a {dep.task} model and cannot serve {task} requests", param="model"
            )
        return dep
