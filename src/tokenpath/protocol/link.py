"""The engine link's own messages: the handshake, clock sync, control and per-request errors.

The link carries these beside the request path's types, which cross it as they are:
`GenerateRequest` (frame `add`), `EmbeddingRequest` (`embed`), `RequestOutput` (`out`),
`EmbeddingOutput` (`vec`) and `EngineState` (`state`, with the engine's step histograms). Every
frame is one of these classes, built and read through `protocol.wire` (the one codec); no end
of the link writes a frame as a dict of its own.

Gateway -> engine: `Hello` (first, with the launch secret), `Ping`, `Reset`, `Abort`,
`StallBound`, and the requests. Engine -> gateway: `Welcome` (with `LinkInfo`) or `Denied`, `Pong`, `ResetDone`,
`LinkError`, and the outputs and state.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenpath import errors
from tokenpath.config import EngineConfig
from tokenpath.errors import ServiceUnavailableError, TokenpathError


@dataclass
class Hello:
    secret: str


@dataclass
class LinkInfo:
    """What the engine says about itself at connect."""

    model: str = ""
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int = 0
    max_num_seqs: int = 0
    pid: int = 0
    task: str = "generate"  # or "embedding"
    dimensions: int = 0  # an embedding model's vector size
    # The settings the engine runs with, typed (a generation engine's; None for an encoder): the
    # gateway reads its chat template, batch size and LoRA rank here, never from the flags it
    # launched the engine with, and a Ray actor's or a custom `engine_command`'s are as exact.
    engine: EngineConfig | None = None


@dataclass
class Welcome:
    now: float  # the engine's monotonic clock
    info: LinkInfo


@dataclass
class Denied:
    message: str


@dataclass
class Ping:
    id: int


@dataclass
class Pong:
    id: int
    now: float  # the engine's monotonic clock when it answered


@dataclass
class Reset:
    """Forget the prefix cache (vLLM's /reset_prefix_cache)."""

    id: int


@dataclass
class ResetDone:
    id: int
    freed: int  # blocks forgotten


@dataclass
class Abort:
    id: str  # the request's id


@dataclass
class StallBound:
    """The gateway's stall bound (`--stall-timeout`), sent once it is known: a step that runs past
    the bound it judges by (`replica.liveness.hang_bound`) is not counted into what a normal step
    of the engine takes (`AsyncEngine.step_ceiling_s`), as in the gateway's own process, so one
    hang that ended does not stretch the bound for every later one."""

    stall_after_s: float


@dataclass
class LinkError:
    """One request's failure, as the engine's typed error: the gateway raises the same type
    (a 400 stays the request's own fault; a `RequestFailedError` is not retried elsewhere)."""

    id: str
    status: int
    message: str
    error_type: str = "service_unavailable"
    param: str | None = None
    code: str | None = None
    cls: str | None = None  # the `tokenpath.errors` class name

    @classmethod
    def of(cls, request_id: str, exc: BaseException) -> LinkError:
        if isinstance(exc, TokenpathError):
            return cls(request_id, exc.status_code, exc.message, exc.error_type, exc.param, exc.code,
                       type(exc).__name__)
        return cls(request_id, 503, f"{type(exc).__name__}: {exc}")

    @classmethod
    def malformed(cls, request_id: str, exc: BaseException, what: str = "request") -> LinkError:
        return cls(request_id, 400, f"malformed {what}: {exc}", "invalid_request_error")

    def exception(self, replica: str) -> TokenpathError:
        """The error to raise on the gateway; an unknown class falls back by status."""
        err = getattr(errors, str(self.cls), None)
        if isinstance(err, type) and issubclass(err, TokenpathError):
            try:
                return err(self.message, param=self.param, code=self.code)
            except TypeError:  # an error type with more required fields: fall back by status
                pass
        if self.status < 500:
            return errors.InvalidRequestError(self.message, param=self.param, code=self.code)
        return ServiceUnavailableError(f"replica '{replica}' failed the request: {self.message}",
                                       code="replica_failed")
