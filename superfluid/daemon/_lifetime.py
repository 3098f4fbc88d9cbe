"""How long a loaded model stays loaded: idle unload and Ollama's ``keep_alive``.

A model is *in use* while an HTTP request holds it (from resolving its name to
the response's end), while its scheduler has anything of a request (a job
queued or running, a reserved place, a tokenize or embedding pending), or
while a session task of it runs (a resumable stream's TTL watcher, a
conversation turn). Once it is idle, its keep-alive counts from the moment it
was last in use:

* a ``keep_alive`` a request gave it (Ollama ``/api/chat``, ``/api/generate``):
  ``0`` unloads it as soon as it is idle, a negative value keeps it for good,
  a duration keeps it that long;
* else ``--idle-timeout SEC`` (0: never), which never unloads the default model.

An unloaded model stays known and loads again on the next request naming it.
One task, :meth:`Lifetimes.run`, in the daemon's root nursery, does every
unload: it sleeps until the earliest expiry or until woken (a request ended, a
keep-alive changed), and polls models that are in use without an HTTP request
(a session, a job left running) every quarter of their keep-alive.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import TYPE_CHECKING, Any, Protocol

import trio

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["FOREVER", "Lifetimes", "expires_at_wall", "parse_keep_alive"]

log = logging.getLogger("superfluid.models")
FOREVER = math.inf
POLL_MIN_S = 0.05        # an in-use model whose keep-alive is short is looked at this often at most
POLL_MAX_S = 5.0         # ... and at least this often
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
    if not math.isfinite(value):
        raise ValueError("keep_alive must be finite")
    return FOREVER if value < 0 else float(value)


class _Model(Protocol):
    name: str
    last_used: float
    keep_alive_s: float | None

    @property
    def in_use(self) -> bool: ...


class _Registry(Protocol):
    default: str | None
    idle_timeout_s: float

    @property
    def loaded(self) -> dict[str, Any]: ...

    async def expire(self, name: str, model: Any) -> bool: ...


def keep_alive_of(model: _Model, *, default: str | None, idle_timeout_s: float) -> float:
    """Seconds ``model`` stays loaded once idle (``FOREVER``: until unloaded by hand)."""
    if model.keep_alive_s is not None:
        return model.keep_alive_s
    if model.name == default or idle_timeout_s <= 0:
        return FOREVER
    return idle_timeout_s


def expires_at_wall(model: _Model, *, default: str | None, idle_timeout_s: float) -> float:
    """The wall-clock time (``time.time()`` scale) ``model`` would be unloaded at if no
    request came; in use, its keep-alive from now. ``FOREVER`` if never."""
    ttl = keep_alive_of(model, default=default, idle_timeout_s=idle_timeout_s)
    if ttl == FOREVER:
        return FOREVER
    now = trio.current_time()
    since = now if model.in_use else model.last_used
    return time.time() + (since + ttl - now)


class Lifetimes:
    """The task that unloads expired models (see the module's docstring)."""

    def __init__(self, registry: _Registry) -> None:
        self.registry = registry
        self._wake = trio.Event()

    def wake(self) -> None:
        """Look again now (a request ended, a keep-alive changed)."""
        self._wake.set()

    def _ttl(self, model: _Model) -> float:
        reg = self.registry
        return keep_alive_of(model, default=reg.default, idle_timeout_s=reg.idle_timeout_s)

    def due(self, models: Iterable[_Model], now: float) -> tuple[list[_Model], float]:
        """The models to unload now, and when to look next (``FOREVER``: only when woken).
        An in-use model's idle time starts over (its ``last_used`` becomes ``now``)."""
        expired: list[_Model] = []
        deadline = FOREVER
        for model in models:
            ttl = self._ttl(model)
            if ttl == FOREVER:
                continue
            if model.in_use:
                model.last_used = now
                deadline = min(deadline, now + min(max(ttl / 4, POLL_MIN_S), POLL_MAX_S))
            elif now >= model.last_used + ttl:
                expired.append(model)
            else:
                deadline = min(deadline, model.last_used + ttl)
        return expired, deadline

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Unload models as they expire, until cancelled."""
        task_status.started()
        while True:
            self._wake = trio.Event()
            expired, deadline = self.due(list(self.registry.loaded.values()), trio.current_time())
            for model in expired:
                await self.registry.expire(model.name, model)
            if expired:
                continue  # unloading took a moment: look again before sleeping
            with trio.move_on_at(deadline):
                await self._wake.wait()
