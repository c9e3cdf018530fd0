"""Typed errors that cross layers.

Every layer raises one of these; `tokenpath.api.errors` maps them once to an OpenAI error body
(`{"error": {"message", "type", "param", "code"}}`) and a status code. Nothing else should build
error responses by hand.
"""

from __future__ import annotations


class TokenpathError(Exception):
    status_code: int = 500
    error_type: str = "internal_error"
    # The `code` of the error body when the raiser gives none (None: the body's code is the type).
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = dict(headers or {})

    def to_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.error_type,
            }
        }


class InvalidRequestError(TokenpathError):
    """A client mistake: bad value, bad shape, too long. Always a 400, never a 500."""

    status_code = 400
    error_type = "invalid_request_error"


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is NaN, infinite, negative or out of range."""


class ContextLengthError(InvalidRequestError):
    default_code = "context_length_exceeded"


class DuplicateRequestIdError(InvalidRequestError):
    """An engine or replica already runs a request under this id, so it refused this one *before*
    taking it on: nothing was started, and the caller must not abort the id (that would stop the
    other request). The gateway mints a unique id per request, so this is defense in depth."""

    default_code = "duplicate_request_id"


class AuthenticationError(TokenpathError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(TokenpathError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(TokenpathError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(TokenpathError):
    """The request conflicts with the resource's state (an unload of a model still serving requests)."""

    status_code = 409
    error_type = "conflict"


class RateLimitError(TokenpathError):
    """429: over a rate limit or quota, or shed by admission control. Carries Retry-After."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float, **kw) -> None:
        super().__init__(message, **kw)
        self.retry_after = max(0.0, retry_after)
        self.headers.setdefault("Retry-After", str(max(1, int(-(-self.retry_after // 1)))))


class ServiceUnavailableError(TokenpathError):
    """503: nothing can serve the request right now (no healthy replica, a backend gone mid-request,
    a store down). Every 503 carries Retry-After, as vLLM's and OpenAI's clients expect: an ejected
    replica is retried or re-admitted within seconds, so the default is short; subclasses that
    know better set their own."""

    status_code = 503
    error_type = "service_unavailable"
    RETRY_AFTER_S = 2

    def __init__(self, message: str, **kw) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(self.RETRY_AFTER_S))


class DeadlineExceededError(TokenpathError):
    """A request still queued past its deadline."""

    status_code = 504
    error_type = "timeout"


class RequestFailedError(TokenpathError):
    """The engine failed while computing this request (its step raised). The engine survived and
    keeps serving; the request is not retried on another replica, since it may be what broke it."""

    status_code = 500
    error_type = "server_error"

    default_code = "engine_failed"


class EngineDeadError(ServiceUnavailableError):
    """The engine's step loop or process died; every in-flight request fails with this.

    It carries Retry-After: the engine is restarted at once (in-process loop, or the supervised
    process after a 1 s backoff) and a sibling replica may take the retry now, so the client is
    told to come back shortly rather than left to guess (OpenAI's SDKs honour the header)."""

    RETRY_AFTER_S = 5


class ModelLoadError(Exception):
    """A model could not be loaded: names the file and the problem. Raised at start-up, not per request."""
