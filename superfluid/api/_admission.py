"""Admission: a key's ``max_concurrent``, counted at one point for every generation.

Every path that generates reaches :func:`~superfluid.api._lane.admit` (HTTP
streamed and whole, resumable, OpenAI, Anthropic, Responses, Ollama,
WebSocket, and conversation turns over HTTP and WebSocket): it claims one of
the calling key's slots (:meth:`Slots.claim`) before the job takes its queue
place. A claim counts while the request that made it holds it, or while its
job is queued or running::

    live = held or (queued and not job.done)

so a generation that outlives its request (a resumable stream whose client
left, a conversation turn whose owner runs on) holds its key's slot until it
ends, and no path can leak one: a job the scheduler took always ends
(SPEC.md §9), and its end frees the slot whoever is left to notice.

Restored generations (after a restart) run for no request and take no slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import attrs

from ._http import ApiError

if TYPE_CHECKING:
    from ..sched import Job
    from ..serving import ApiKey

__all__ = ["Claim", "Slots"]


@attrs.define(eq=False)
class Claim:
    """One generation's hold on its key's slot (:class:`Slots`)."""

    job: Job
    held: bool = True      # the admitting request is still inside its block
    queued: bool = False   # the scheduler has the job: its end is certain, and frees the slot

    @property
    def live(self) -> bool:
        return self.held or (self.queued and not self.job.done)


class Slots:
    """The claims of each key with a ``max_concurrent`` (at most that many kept per key)."""

    def __init__(self) -> None:
        self._claims: dict[str, list[Claim]] = {}

    def held(self, key: str) -> int:
        """How many generations key ``key`` has now."""
        return sum(c.live for c in self._claims.get(key, ()))

    @contextmanager
    def claim(self, key: ApiKey | None, job: Job) -> Iterator[Claim]:
        """Claim one of ``key``'s slots for ``job``: the block is the request's
        hold; set ``queued`` once the scheduler has the job, so the slot stays
        taken until the job ends. Nothing is counted with no key or no limit.

        Raises:
            ApiError: 429 ``concurrency_limit_exceeded`` when the key's generations
                hold all its slots.
        """
        claim = Claim(job)
        if key is None or not key.max_concurrent:
            yield claim
            return
        live = [c for c in self._claims.get(key.name, ()) if c.live]
        if len(live) >= key.max_concurrent:
            self._claims[key.name] = live
            raise ApiError(429, f"this API key already has {len(live)} generations running (its max_concurrent); "
                                "a resumable stream or a conversation turn holds its slot until it ends",
                           code="concurrency_limit_exceeded", type="rate_limit_error",
                           headers=((b"retry-after", b"1"),))
        self._claims[key.name] = [*live, claim]
        try:
            yield claim
        finally:
            claim.held = False


def granted_keep_alive(admin: bool, seconds: float | None) -> float | None:
    """An Ollama ``keep_alive`` as the calling key may set it. Loading and
    unloading are an admin's (SPEC.md §10), so only an admin key (or a daemon
    with no keys) changes how long a model stays loaded: ``0`` unloads it and
    ``-1`` pins it past ``--idle-timeout``. Any other key's value is ignored
    (None: no change), not refused, as Ollama's clients send one by habit."""
    return seconds if admin else None
