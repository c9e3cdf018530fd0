"""The one place where errors become HTTP responses.

Typed `TokenpathError`s carry their status and OpenAI body; FastAPI/pydantic validation errors
(including malformed JSON) become 400s in the same shape, never FastAPI's default 422 body; any
other exception is logged and becomes a 500 without leaking internals.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenpath.errors import InvalidRequestError, TokenpathError

log = logging.getLogger("tokenpath.api")

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 431: "invalid_request_error"}


# A route's documented error responses (FastAPI's `responses=`): status -> OpenAPI response object.
OpenApiResponses = dict[int | str, dict[str, Any]]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code or type_}}


def error_response(exc: TokenpathError, extra_headers: dict[str, str] | None = None) -> JSONResponse:
    headers = {**exc.headers, **(extra_headers or {})}
    return JSONResponse(exc.to_body(), status_code=exc.status_code, headers=headers)


# The fields a body must have, per route: named when the body is empty.
_REQUIRED = {"/v1/chat/completions": ("model", "messages"), "/v1/completions": ("model", "prompt"),
             "/v1/embeddings": ("model", "input"), "/v1/messages": ("model", "messages", "max_tokens"),
             "/v1/messages/count_tokens": ("model", "messages"),
             "/v1/responses": ("model", "input"), "/v1/score": ("model", "text_1", "text_2"),
             "/v1/rerank": ("model", "query", "documents")}
# (a constrained branch, `Annotated[str, Field(max_length=...)]` in a union, is tagged `constrained-str`)
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str", "constrained-int"}


def _clean_loc(loc: tuple) -> list[str]:
    """The parameter path of a pydantic error: without the 'body' root and without union-branch tags
    ('str', 'list[ContentPart]', 'function-after[...]'), which name types, not parameters."""
    out: list[str] = []
    for p in loc:
        p = str(p)
        if p == "body" and not out:
            continue
        if p in _TYPE_TAGS or "[" in p:
            continue
        out.append(p)
    return out


def validation_error(exc: RequestValidationError, request: Request | None = None) -> InvalidRequestError:
    """The first pydantic error as a 400 that names the parameter and what to send instead."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    kind = first.get("type")
    loc = _clean_loc(first.get("loc", ()))
    path = request.url.path if request is not None else ""
    if kind == "tokenpath_param":  # our own validators carry the parameter
        return InvalidRequestError(str(first.get("msg")), param=(first.get("ctx") or {}).get("param"))
    if kind == "json_invalid":
        return InvalidRequestError(f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if not loc and kind == "missing":
        needed = _REQUIRED.get(path, ("model",))
        return InvalidRequestError("the request body is empty; send a JSON object with "
                                   + " and ".join(f"'{n}'" for n in needed), param=needed[0], code="invalid_json")
    if not loc and kind in {"model_attributes_type", "dict_type"}:
        ctype = request.headers.get("content-type", "") if request is not None else "application/json"
        if "json" not in ctype.lower():
            return InvalidRequestError(f"the body must be JSON sent with 'Content-Type: application/json' "
                                       f"(got {ctype or 'no Content-Type'!r})", param="Content-Type",
                                       code="invalid_content_type")
        return InvalidRequestError("the body must be a JSON object, such as {\"model\": ..., ...}",
                                   code="invalid_json")
    param = ".".join(loc) or None
    if kind == "extra_forbidden":
        return InvalidRequestError(f"unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return InvalidRequestError(f"Missing required parameter: '{param}'", param=param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    others = [e for e in errors[1:] if ".".join(_clean_loc(e.get("loc", ()))) != param]
    more = f" (and {len(others)} more problems)" if others else ""
    return InvalidRequestError(f"{param}: {msg}{more}" if param else msg + more, param=param)


# How a request refused by the schema (before its route ran) is still recorded: (request, error, raw body).
Refusal = Callable[[Request, TokenpathError, object], Awaitable[Response]]
# Another API's error shape on its own paths (`api.anthropic.errors.reshape_for`): the OpenAI
# response in, that API's out.
Reshape = Callable[[Request, Response], Response]


def install_error_handlers(app: FastAPI, refuse: Refusal | None = None, reshape: Reshape | None = None) -> None:
    """`refuse` records schema refusals like any other ending (audit row, log line, metrics); without
    it (an app built without request bookkeeping) they are only answered. `reshape` gives every
    error answered here another API's shape where the path is that API's."""

    def shaped(request: Request, response: Response) -> Response:
        return response if reshape is None else reshape(request, response)

    @app.exception_handler(TokenpathError)
    async def _typed(request: Request, exc: TokenpathError) -> Response:
        return shaped(request, error_response(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        error = validation_error(exc, request)
        if refuse is not None:
            return shaped(request, await refuse(request, error, exc.body))
        return shaped(request, error_response(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error")
        return shaped(request, JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                                            headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return shaped(request, JSONResponse(error_body("internal server error", "internal_error"), status_code=500))
