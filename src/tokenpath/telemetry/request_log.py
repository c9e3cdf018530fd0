"""Logs: one structured line per finished request, and operational events, JSON or text.

`configure_logging("json" | "text", level)` installs one stdout handler on the root logger
(uvicorn's loggers included, so nothing prints in a second format). A record's `extra` fields
become JSON keys (`logging.info("...", extra={"event": "replica_ejected", "replica": ...})`).

The request line (logger `tokenpath.request`, INFO) carries time, request id (and the client's
`x-request-id`), trace id, tenant, key prefix, model, replica, status, error code, token counts
and each stage's milliseconds -- the same numbers as the response's Server-Timing header. It
never carries a key, and carries prompt/completion text only under `TOKENPATH_AUDIT_TEXT=1`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from tokenpath.telemetry.causes import compact
from tokenpath.telemetry.record import FinishedRequest

REQUEST_LOGGER = "tokenpath.request"
LOG_FORMATS = ("json", "text")
# LogRecord's own attributes: everything else on a record came from `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


# One encoder for every line (`json.dumps` with arguments builds one per call); it keeps no state.
_ENCODE = json.JSONEncoder(default=str, separators=(",", ":")).encode


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _iso(created: float) -> str:
    return dt.datetime.fromtimestamp(created, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, msg, then the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": _iso(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _ENCODE(out)


class TextFormatter(logging.Formatter):
    """`time level logger: msg key=value ...` for people reading a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={json.dumps(v, default=str) if not isinstance(v, str) else v}"
                          for k, v in _extras(record).items() if v is not None)
        line = f"{_iso(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        line = f"{line} {extras}" if extras else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(fmt: str = "json", level: str | int = "INFO") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # through our handler, in our format
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True


def request_fields(rec: FinishedRequest) -> dict[str, Any]:
    """The request line's fields (also what the dashboard shows for a recent request)."""
    a = rec.timeline.attrs
    fields: dict[str, Any] = {
        "event": "request", "request_id": rec.request_id, "client_request_id": rec.client_request_id,
        "trace_id": a.get("trace_id"), "endpoint": rec.endpoint, "tenant": rec.tenant,
        "key_prefix": rec.key_prefix, "model": rec.model or rec.requested_model, "replica": a.get("replica"),
        "routing_reason": a.get("reason"), "priority": rec.priority, "status": rec.status,
        "error_type": rec.error_type, "error_code": rec.error_code,
        "finish_reason": ",".join(rec.finish_reasons) or None, "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens, "cached_tokens": rec.cached_tokens,
        # Server-Timing's own numbers, so a log line and a response header never disagree.
        "stages_ms": {k: round(v * 1000, 1) for k, v in rec.timeline.durations().items()},
        "causes": compact(rec.causes()),
    }
    if a.get("backend_timing") is not None:  # a URL replica: whose clock its engine stages came from
        fields["backend_timing"] = a["backend_timing"]
    own = rec.timeline.own_path()
    if own is not None:  # a URL replica's: the gateway's own ms before the backend and to the client's first byte
        fields["gateway_path_ms"] = own
    if rec.prompt_text is not None:
        fields["prompt_text"] = rec.prompt_text
    if rec.completion_text is not None:
        fields["completion_text"] = rec.completion_text
    return fields


def log_request(rec: FinishedRequest, fields: Callable[[], dict[str, Any]] | None = None) -> None:
    """The request line; `fields`: where its fields come from when they are shared (`publish`
    builds them once for this line and the dashboard's row), else `request_fields`."""
    logger = logging.getLogger(REQUEST_LOGGER)
    if not logger.isEnabledFor(logging.INFO):
        return
    level = logging.WARNING if rec.status >= 500 else logging.INFO
    f = fields() if fields is not None else request_fields(rec)
    logger.log(level, "%s %s %s %d", rec.endpoint, f["model"], rec.request_id, rec.status, extra=f)


def log_event(logger: logging.Logger, event: str, message: str, *, level: int = logging.INFO,
              **fields: Any) -> None:
    """An operational event (startup, replica ejected/recovered, engine died) as one line."""
    logger.log(level, message, extra={"event": event, **fields})
