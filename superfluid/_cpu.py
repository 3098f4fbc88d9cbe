"""The daemon yields the CPU to the engine while it only relays tokens.

On a machine where the daemon shares cores with the engine (two cores here,
both running llama.cpp's threads), every frame the worker writes wakes the
daemon, and Linux lets a woken task preempt the running one: the daemon ran
~0.7 ms of Python on a core a llama.cpp thread was computing on, and the
other thread spun at the graph's barrier meanwhile. ``SCHED_BATCH`` tasks do
not preempt on wake-up (they run at the next scheduler tick or on an idle
core), so while no request is waiting for its first token the daemon's main
thread runs ``SCHED_BATCH``; as soon as one is (a tokenize in flight, a job
queued or admitted without a token yet) it is back to ``SCHED_OTHER``, so
time to first token does not pay for it. Measured at 1 concurrent (SmolLM2,
2 cores): engine idle between steps 0.35-0.46 → 0.15 s per 18 s, steps 8.6
→ 8.0 ms, throughput +8%; the daemon its whole life on ``SCHED_BATCH`` added
~14 ms to time to first token.

Linux only; elsewhere (or with ``--no-cpu-yield``) nothing changes. The
policy is per thread: only the thread that owns this object is switched, and
workers reset theirs at start (a child inherits its parent's policy).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["CpuYield", "reset_policy", "unyielding"]

log = logging.getLogger("superfluid.cpu")


class CpuYield:
    """Tracks who needs the daemon responsive; runs ``SCHED_BATCH`` when nobody does."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH")
        self._urgent: set[object] = set()
        self.batch = False
        self.switches = 0
        self._apply()

    def note(self, owner: object, *, urgent: bool) -> None:
        """``owner`` has a client waiting on the daemon right now (a scheduler: a request
        waiting for its first token, or the commit of a request's last tokens), or not."""
        if urgent:
            self._urgent.add(owner)
        else:
            self._urgent.discard(owner)
        self._apply()

    def close(self) -> None:
        """Back to ``SCHED_OTHER`` for good."""
        if self.enabled and self.batch:
            self._set(batch=False)
        self.enabled = False
        self._urgent.clear()

    def _apply(self) -> None:
        want = not self._urgent
        if self.enabled and want != self.batch:
            self._set(batch=want)

    def _set(self, *, batch: bool) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH if batch else os.SCHED_OTHER, os.sched_param(0))
        except OSError as exc:  # a sandbox may refuse it: run as before
            log.info("cannot change the scheduling policy (%s); the daemon does not yield the CPU", exc)
            self.enabled = False
            return
        self.batch = batch
        self.switches += 1


def unyielding(fn: Callable[[], T]) -> T:
    """Run ``fn`` on ``SCHED_OTHER``: for work handed to a thread (``trio.to_thread``
    reuses threads, which keep the policy of the thread that started them)."""
    reset_policy()
    return fn()


def reset_policy() -> None:
    """Back to ``SCHED_OTHER`` (a worker spawned while the daemon ran ``SCHED_BATCH``)."""
    if hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass
