"""Where the daemon's log goes: stderr (one line a record, the startup summary bare),
and with ``--log-dir DIR`` also JSON lines in ``DIR/superfluid.jsonl``.

The file is written by a thread (``QueueListener``), so the event loop never
waits on a disk; the queue between them is bounded and a record that finds it
full is dropped and counted (:data:`dropped`). Files rotate by size
(``ROTATE_BYTES``, ``BACKUPS`` kept) and are created 0600 in a 0700 directory:
access lines name models and sessions.

Records carry what clients sent (paths, model names, error messages quoting a
body): every formatter here escapes control characters where it writes
(``_printable.py``), so no request forges a line or drives the terminal of
whoever reads the log, whichever call logged it.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import logging.handlers
import os
import queue
import sys
from pathlib import Path
from typing import Any, TextIO

from .._printable import json_printable, printable
from .._private import FILE_MODE, make_private_dir

__all__ = ["BACKUPS", "LOG_FILE", "LINE_FORMAT", "ROTATE_BYTES", "JsonFormatter", "PrintableFormatter", "close_logging",
           "configure_logging", "dropped"]

LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

LOG_FILE = "superfluid.jsonl"
ROTATE_BYTES = 16 << 20
BACKUPS = 4
QUEUE_RECORDS = 10_000
dropped = 0   # records the file's queue had no room for

_TRACEBACKS = logging.Formatter()
_listener: logging.handlers.QueueListener | None = None
_installed: list[logging.Handler] = []


class PrintableFormatter(logging.Formatter):
    """A text formatter a person can read safely: the message with every control
    character escaped (a newline in it is ``\\x0a``, not a forged line); a traceback
    keeps its line breaks, and each line after a record's first is indented, so only
    a record starts at column 0 even when an exception's message quotes a client."""

    def __init__(self, fmt: str = LINE_FORMAT, datefmt: str | None = None) -> None:
        super().__init__(fmt, datefmt)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)  # format() sets it afresh for every handler
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), keep_newlines=True).replace("\n", "\n  ")


class _StderrFormatter(PrintableFormatter):
    """``time LEVEL logger: message``; the startup summary's lines bare."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == "superfluid.summary":
            return printable(record.getMessage())
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a record: ``ts``, ``level``, ``logger``, ``msg``; an access
    line's fields (``method``, ``path``, ``status``, ``qos``, ``model``, tokens,
    ``duration_ms``, ``ttft_ms``, …) at the top level; ``exc`` for a traceback. Values
    are exact; every control, separator and bidi character is a JSON escape, so a
    record is one line however it is split and the file is safe to ``cat``."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            obj.update(access)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # through the file's queue (_BoundedQueueHandler.prepare)
            obj["exc"] = record.exc_text
        return json_printable(json.dumps(obj, ensure_ascii=False, default=str))


class _PrivateRotatingHandler(logging.handlers.RotatingFileHandler):
    """A size-rotated file created 0600 (rotated files keep the mode)."""

    def _open(self) -> TextIO:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        os.fchmod(fd, FILE_MODE)  # an older file of looser mode is tightened
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)  # noqa: SIM115 - the handler owns it


class _BoundedQueueHandler(logging.handlers.QueueHandler):
    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """A copy with the message merged and the traceback kept apart as text
        (``exc_text``), so the JSON line has it as ``exc`` (the base class folds it into
        ``msg`` and drops it)."""
        out = copy.copy(record)
        out.msg = out.message = record.getMessage()
        out.args = None
        if record.exc_info:
            out.exc_text = _TRACEBACKS.formatException(record.exc_info)
        out.exc_info = None
        return out

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
