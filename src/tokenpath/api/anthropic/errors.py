"""Errors on /v1/messages in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

Every error is raised and answered once, as everywhere (`api.errors`, `RequestRun.respond_to`);
on these paths the OpenAI body is then reshaped here, so there is one mapping. Status codes are
Anthropic's: 413 `request_too_large`, 429 `rate_limit_error` (with `retry-after`), 500
`api_error`, 504 `timeout_error`, and 529 `overloaded_error` where Anthropic uses it, for the
server being full rather than the caller being over its limits: no healthy replica (503 on the
OpenAI routes), an engine that died (503), admission's full queue and an unreachable deadline
(429 there). A tenant over its own quota or its own queue share stays a 429.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response

PATH = "/v1/messages"
OVERLOADED = 529
_OVERLOADED_CODES = {"queue_full", "deadline_unreachable"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
          403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 504: "timeout_error", OVERLOADED: "overloaded_error"}


# The chat pipeline names the fields of the chat request a Messages body became; these are the
# Messages body's own names for them (tool checks run on the translated `tools`).
_FIELD_NAMES = ((".function.parameters", ".input_schema"), (".function.name", ".name"),
                (".function.description", ".description"), ("stop has ", "stop_sequences has "),
                )


def _messages_names(text: str) -> str:
    for chat, anthropic in _FIELD_NAMES:
        text = text.replace(chat, anthropic)
    return text


def anthropic_error(status: int, error: dict) -> tuple[int, dict]:
    """(status, body) of an OpenAI-shaped `error` object answered with `status`."""
    code = error.get("code")
    if status == 503 or (status == 429 and code in _OVERLOADED_CODES):
        status = OVERLOADED
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = _messages_names(str(error.get("message", "")))
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def stream_error(body: dict) -> dict:
    """An error event's data in a stream (the OpenAI error body the pipeline yields)."""
    error = body.get("error") or {}
    status = {"invalid_request_error": 400, "rate_limit_error": 429, "service_unavailable": 503,
              "timeout": 504}.get(str(error.get("type")), 500)
    return anthropic_error(status, error)[1]


def is_messages(request: Request) -> bool:
    path = request.url.path
    return path == PATH or path.startswith(PATH + "/")


def reshape(response: Response) -> Response:
    """An OpenAI-shaped JSON error response as Anthropic's, its headers (retry-after, x-request-id,
    server-timing, rate-limit headers) kept; anything else unchanged."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    try:
        body = json.loads(bytes(response.body))
    except ValueError:
        return response
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return response
    status, out = anthropic_error(response.status_code, error)
    headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
    return JSONResponse(out, status_code=status, headers=headers)


def reshape_for(request: Request, response: Response) -> Response:
    """`reshape` on the Messages paths only (the app's error handlers and body limits call it)."""
    return reshape(response) if is_messages(request) else response
