"""The one place where errors become HTTP responses.

Typed `TokenpathError`s carry their status and OpenAI body; FastAPI/pydantic validation errors
(including malformed JSON) become 400s in the same shape, never FastAPI's default 422 body; any
other exception is logged and becomes a 500 without leaking internals.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenpath.errors import InvalidRequestError, TokenpathError

log = logging.getLogger("tokenpath.api")

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 431: "invalid_request_error"}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code or type_}}


def error_response(exc: TokenpathError, extra_headers: dict[str, str] | None = None) -> JSONResponse:
    headers = {**exc.headers, **(extra_headers or {})}
    return JSONResponse(exc.to_body(), status_code=exc.status_code, headers=headers)


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """The first pydantic error as a readable 400: 'messages.0.role: Input should be ...'."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
    if first.get("type") in {"model_attributes_type", "dict_type"} and not loc:
        return InvalidRequestError("the body must be a JSON object", code="invalid_json")
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "extra_forbidden":
        msg = f"unrecognized request argument supplied: {param}"
    elif param:
        msg = f"{param}: {msg}"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return InvalidRequestError(msg + more, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TokenpathError)
    async def _typed(request: Request, exc: TokenpathError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error")
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "internal_error"), status_code=500)
