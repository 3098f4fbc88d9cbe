"""How long a loaded model stays loaded: idle unload and Ollama's ``keep_alive``.

A model is *in use* while an HTTP request holds it (from resolving its name to
the response's end), while its scheduler has anything of a request (a job
queued or running, a reserved place, a tokenize or embedding pending), or
while a session task of it runs (a resumable stream's TTL watcher, a
conversation turn), or while a conversation naming it is pinned (``POST
/v1/sessions/{id}/pin``: a pinned conversation holds its model until the pin's
deadline, a wall-clock time kept in the log, so it holds across a restart; the
registry's ``pinned_until``). Once it is idle, its keep-alive counts from the moment it
was last in use:

* a ``keep_alive`` a request gave it (Ollama ``/api/chat``, ``/api/generate``):
  ``0`` unloads it as soon as it is idle, a negative value keeps it for good,
  a duration keeps it that long;
* else ``--idle-timeout SEC`` (0: never), which never unloads the default model.

An unloaded model stays known and loads again on the next request naming it.
One task, :meth:`Lifetimes.run`, in the registry's models nursery
(``ModelRegistry.run``), does every unload (each returns once the model's
actor and worker have ended): it sleeps until the earliest expiry or until
woken (a request ended, a keep-alive changed), and polls models that are in
use without an HTTP request (a session, a job left running) every quarter of
their keep-alive.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import trio

# the keep-alive arithmetic lives below the api, which parses a request's keep_alive (serving/_keepalive.py)
from ..serving._keepalive import FOREVER, Expiring, expires_at_wall, keep_alive_of, parse_keep_alive

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["FOREVER", "Lifetimes", "expires_at_wall", "parse_keep_alive"]

log = logging.getLogger("superfluid.models")
POLL_MIN_S = 0.05        # an in-use model whose keep-alive is short is looked at this often at most
POLL_MAX_S = 5.0         # ... and at least this often


class _Registry(Protocol):
    default: str | None
    idle_timeout_s: float
    pinned_until: Callable[[str, float], float]

    @property
    def loaded(self) -> dict[str, Any]: ...

    async def expire(self, name: str, model: Any) -> bool: ...


class Lifetimes:
    """The task that unloads expired models (see the module's docstring)."""

    def __init__(self, registry: _Registry) -> None:
        self.registry = registry
        self._wake = trio.Event()

    def wake(self) -> None:
        """Look again now (a request ended, a keep-alive changed)."""
        self._wake.set()

    def _ttl(self, model: Expiring) -> float:
        reg = self.registry
        return keep_alive_of(model, default=reg.default, idle_timeout_s=reg.idle_timeout_s)

    def due(self, models: Iterable[Expiring], now: float) -> tuple[list[Expiring], float]:
        """The models to unload now, and when to look next (``FOREVER``: only when woken).
        An in-use or pinned model's idle time starts over (its ``last_used`` becomes ``now``)."""
        expired: list[Expiring] = []
        deadline = FOREVER
        wall = time.time()
        pinned_until = getattr(self.registry, "pinned_until", None)
        for model in models:
            ttl = self._ttl(model)
            if ttl == FOREVER:
                continue
            pinned = (pinned_until(model.name, wall) - wall) if pinned_until is not None else 0.0
            if model.in_use or pinned > 0:  # a pinned conversation holds its model: looked at again as it ends
                model.last_used = now
                poll = min(max(ttl / 4, POLL_MIN_S), POLL_MAX_S)
                deadline = min(deadline, now + (poll if model.in_use or pinned > poll else max(pinned, POLL_MIN_S)))
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
