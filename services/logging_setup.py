"""Structured logs with the current request id and trace id.

``setup_logging(service, level, fmt)`` configures the root logger once per process: one line per
record, JSON (``{"ts":..., "level":..., "logger":..., "service":..., "request_id":..., "msg":...}``)
or text (``ts LEVEL logger [service] rid=... trace=... msg``); JSON lines also carry ``trace_id``
(32 hex digits, the W3C/OpenTelemetry trace of the request) when there is one. Both come from
contextvars, so they follow asyncio tasks: set them where a request enters a service::

    with request_context(request.request_id, trace_id):
        ...   # every log line in here (and in tasks created here) carries them

Extra fields: ``logger.info("sent", extra={"fields": {"blocks": 12}})`` adds them to the record.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
import json
import logging
import sys
import time

request_id_var: ContextVar[str] = ContextVar("pdserve_request_id", default="")
trace_id_var: ContextVar[str] = ContextVar("pdserve_trace_id", default="")


def current_request_id() -> str:
    return request_id_var.get()


@contextmanager
def request_context(request_id: str, trace_id: str = "") -> Iterator[None]:
    token = request_id_var.set(request_id)
    ttoken = trace_id_var.set(trace_id)
    try:
        yield
    finally:
        try:
            trace_id_var.reset(ttoken)
            request_id_var.reset(token)
        except ValueError:
            # an async generator closed by the loop's finalizer runs in another Context:
            # the variables it set belong to the original one, nothing to restore here
            pass


class _ContextFilter(logging.Filter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.trace_id = trace_id_var.get()
        record.service = self.service
        return True


def _ts(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": _ts(record), "level": record.levelname, "logger": record.name,
               "service": getattr(record, "service", ""), "msg": record.getMessage()}
        rid = getattr(record, "request_id", "")
        if rid:
            out["request_id"] = rid
        tid = getattr(record, "trace_id", "")
        if tid:
            out["trace_id"] = tid
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", "")
        line = f"{_ts(record)} {record.levelname:<7} {record.name} [{getattr(record, 'service', '')}]"
        if rid:
            line += f" rid={rid}"
        tid = getattr(record, "trace_id", "")
        if tid:
            line += f" trace={tid}"
        line += " " + record.getMessage()
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            line += "".join(f" {k}={v}" for k, v in extra.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str = "INFO", fmt: str = "json", stream=None) -> None:
    """(Re)configure the root logger: one stream handler (stderr by default)."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be json or text, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_ContextFilter(service))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
