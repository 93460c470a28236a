"""Logging for the server and the engine process: one handler on the root logger, in text or JSON lines, and every
record made while a request is being served tagged with that request's X-Request-Id.

The id lives in a context variable that the request-id middleware sets around each request; asyncio tasks copy
the context they are created in, so records from the request's handler, its streaming task and uvicorn's access
log line all carry it. uvicorn is started without a logging config of its own, so its loggers go through here too.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import datetime, timezone

from server.settings import LogFormat

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)
"""The X-Request-Id of the request being served in this context (None outside requests)."""


class _RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (`record.request_id`, None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class _TextFormatter(logging.Formatter):
    def __init__(self, label: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s [{label}] %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        rid = getattr(record, "request_id", None)
        return line if rid is None else f"{line} [request_id={rid}]"


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id, and the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, log_format: LogFormat, label: str = "%(name)s") -> None:
    """Send every record at `level` or above to stderr in `log_format`; `label` names the source in text lines
    (the logger's name by default; the engine process says `engine`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(_JsonFormatter() if log_format == "json" else _TextFormatter(label))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
