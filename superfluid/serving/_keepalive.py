"""Ollama's ``keep_alive`` and how long a served model stays loaded once idle: the parsing and
the arithmetic, shared by the HTTP handlers (``api``) and the unloading task
(``daemon/_lifetime.py``, which explains the rules)."""

from __future__ import annotations

import math
import re
import time
from typing import Any, Protocol

import trio

__all__ = ["FOREVER", "Expiring", "expires_at_wall", "keep_alive_of", "parse_keep_alive"]

FOREVER = math.inf
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's ``keep_alive``: seconds to stay loaded once idle (``FOREVER`` for a
    negative value), or None when absent.

    Accepted: a number of seconds, or a string: a number of seconds, or a Go
    duration (``"5m"``, ``"1h30m"``, ``"30s"``, ``"-1m"``).

    Raises:
        ValueError: anything else (one line, for a 400).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("keep_alive must be a duration (\"5m\", \"30s\"), a number of seconds, 0 or -1")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration (\"5m\", \"30s\", \"1h30m\"), "
                                 "a number of seconds, 0 or -1") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
        value = sign * seconds
    if isinstance(value, int) and abs(value) > 1 << 62:   # (an int past a float's range: math.isfinite raises)
        value = math.inf if value > 0 else -math.inf
    if not math.isfinite(value):
        raise ValueError("keep_alive must be finite")
    return FOREVER if value < 0 else float(value)


class Expiring(Protocol):
    """What the keep-alive arithmetic reads of a served model."""

    name: str
    last_used: float
    keep_alive_s: float | None

    @property
    def in_use(self) -> bool: ...


def keep_alive_of(model: Expiring, *, default: str | None, idle_timeout_s: float) -> float:
    """Seconds ``model`` stays loaded once idle (``FOREVER``: until unloaded by hand)."""
    if model.keep_alive_s is not None:
        return model.keep_alive_s
    if model.name == default or idle_timeout_s <= 0:
        return FOREVER
    return idle_timeout_s


def expires_at_wall(model: Expiring, *, default: str | None, idle_timeout_s: float,
                    pinned_until: float = 0.0) -> float:
    """The wall-clock time (``time.time()`` scale) ``model`` would be unloaded at if no
    request came; in use, its keep-alive from now; pinned by a conversation until
    ``pinned_until`` (wall time), its keep-alive from then. ``FOREVER`` if never."""
    ttl = keep_alive_of(model, default=default, idle_timeout_s=idle_timeout_s)
    if ttl == FOREVER:
        return FOREVER
    now = trio.current_time()
    since = now if model.in_use else model.last_used
    return max(time.time() + (since + ttl - now), pinned_until + ttl)
