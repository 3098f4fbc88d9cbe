"""Where the daemon's log goes: stderr (one line a record, the startup summary bare),
and with ``--log-dir DIR`` also JSON lines in ``DIR/superfluid.jsonl``.

The file is written by a thread (``QueueListener``), so the event loop never
waits on a disk; the queue between them is bounded and a record that finds it
full is dropped and counted (:data:`dropped`). Files rotate by size
(``ROTATE_BYTES``, ``BACKUPS`` kept) and are created 0600 in a 0700 directory:
access lines name models and sessions.
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import os
import queue
import sys
from pathlib import Path
from typing import Any, TextIO

from .._private import FILE_MODE, make_private_dir

__all__ = ["BACKUPS", "LOG_FILE", "ROTATE_BYTES", "JsonFormatter", "close_logging", "configure_logging", "dropped"]

LOG_FILE = "superfluid.jsonl"
ROTATE_BYTES = 16 << 20
BACKUPS = 4
QUEUE_RECORDS = 10_000
dropped = 0   # records the file's queue had no room for

_listener: logging.handlers.QueueListener | None = None
_installed: list[logging.Handler] = []


class _StderrFormatter(logging.Formatter):
    """``time LEVEL logger: message``; the startup summary's lines bare."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "superfluid.summary":
            return record.getMessage()
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a record: ``ts``, ``level``, ``logger``, ``msg``; an access
    line's fields (``method``, ``path``, ``status``, ``qos``, ``model``, tokens,
    ``duration_ms``, ``ttft_ms``, …) at the top level; ``exc`` for a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            obj.update(access)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False, default=str)


class _PrivateRotatingHandler(logging.handlers.RotatingFileHandler):
    """A size-rotated file created 0600 (rotated files keep the mode)."""

    def _open(self) -> TextIO:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        os.fchmod(fd, FILE_MODE)  # an older file of looser mode is tightened
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)  # noqa: SIM115 - the handler owns it


class _BoundedQueueHandler(logging.handlers.QueueHandler):
    def enqueue(self, record: logging.LogRecord) -> None:
        global dropped
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            dropped += 1


QUIET_LIBRARIES = ("httpx", "httpx2", "httpcore", "huggingface_hub", "filelock")


def configure_logging(level: str = "INFO", log_dir: Path | None = None, *, stream: TextIO | None = None) -> None:
    """Install the daemon's handlers on the root logger (replacing earlier ones of ours).

    Raises:
        ValueError: ``level`` is not a logging level name.
        OSError: ``log_dir`` cannot be created or written.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"--log-level {level}: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    close_logging()
    root = logging.getLogger()
    root.setLevel(numeric)
    # the HTTP clients huggingface_hub uses log every request at INFO: a pull is shown by its own
    # progress, so theirs speak only from WARNING up unless the daemon is asked for DEBUG
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING if numeric > logging.DEBUG else logging.NOTSET)
    err = logging.StreamHandler(stream or sys.stderr)
    err.setFormatter(_StderrFormatter())
    handlers: list[logging.Handler] = [err]
    if log_dir is not None:
        global _listener
        make_private_dir(log_dir)
        os.chmod(log_dir, 0o700)
        file_handler = _PrivateRotatingHandler(log_dir / LOG_FILE, maxBytes=ROTATE_BYTES, backupCount=BACKUPS,
                                               encoding="utf-8")
        file_handler.setFormatter(JsonFormatter())
        q: queue.Queue[logging.LogRecord] = queue.Queue(QUEUE_RECORDS)
        _listener = logging.handlers.QueueListener(q, file_handler, respect_handler_level=False)
        _listener.start()
        handlers.append(_BoundedQueueHandler(q))
    for handler in handlers:
        root.addHandler(handler)
        _installed.append(handler)


def close_logging() -> None:
    """Remove our handlers; the file's thread writes what is queued and stops."""
    global _listener
    root = logging.getLogger()
    for handler in _installed:
        root.removeHandler(handler)
    _installed.clear()
    if _listener is not None:
        _listener.stop()
        for handler in _listener.handlers:
            handler.close()
        _listener = None
