"""Where a request of a fleet model runs: one of its nodes' actors (SPEC.md §14).

A model served by fleet nodes has one :class:`~superfluid.nursery.ModelActor` per
node (its scheduler, its link) in a :class:`FleetGroup`. A request is placed as a
whole on one node when its lane opens (``ServedModel.place``); a node whose link is
lost sheds what waits on it to the others (:meth:`FleetGroup.shed`, called by that
node's actor between links), and its jobs continue there from their committed
tokens. Policies (``--fleet-policy``), among the nodes whose link is up and whose
window holds the request:

- ``load-aware`` (default): skip nodes whose KV pool is at or above
  ``--fleet-pool-high``; then the lowest load per lane (running and queued jobs over
  the node's lanes), ties to the node that was idle longest;
- ``least-loaded``: the fewest running and queued jobs;
- ``round-robin``: each in turn.

With no node up, a request waits on one of them (the first to come back serves it).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from ..nursery import ModelActor
    from ..sched import Job, Scheduler

__all__ = ["POLICIES", "FleetGroup"]

POLICIES = ("load-aware", "least-loaded", "round-robin")


def _lanes(actor: ModelActor) -> int:
    ack = actor.ack
    limits = ack.limits if ack is not None else {}
    return max(1, int(limits.get("max_lanes", actor.spec.max_batch) or 1))


def _window(actor: ModelActor) -> int:
    return int(actor.info.get("n_ctx_seq", 0))


def _load(actor: ModelActor) -> int:
    core = actor.scheduler.core
    return len(core.running) + sum(len(q) for q in core.queues.values())


def _kv_use(actor: ModelActor) -> float:
    tick = actor.scheduler.core.last_tick
    total = tick.get("kv_total", 0)
    return tick.get("kv_used", 0) / total if total else 0.0


@attrs.define(eq=False)
class FleetGroup:
    """The nodes serving one model name (node identity -> its actor)."""

    policy: str = "load-aware"
    pool_high: float = 0.9
    members: dict[str, ModelActor] = attrs.field(factory=dict)
    _turns: Any = attrs.field(factory=itertools.count)
    _placed: set[Job] = attrs.field(factory=set)   # jobs placed here and not yet done (``place``)

    @staticmethod
    def is_up(actor: ModelActor) -> bool:
        sched = actor.scheduler
        return sched.core.link_up and sched.closed is None and not actor.stopped

    def live(self) -> list[ModelActor]:
        return [a for a in self.members.values() if self.is_up(a)]

    @property
    def window(self) -> int:
        """The largest window of a node that is up (of any node when none is)."""
        pool = self.live() or list(self.members.values())
        return max((_window(a) for a in pool), default=0)

    def place(self, need: int = 0, *, among: list[ModelActor] | None = None, job: Job | None = None) -> ModelActor:
        """The node for a request of ``need`` tokens (prompt and what it may generate). ``job``
        counts on the chosen node from now on: requests that arrive together are spread before
        any of them reached a node's scheduler (its queue shows them only once its actor ran)."""
        live = self.live() if among is None else among
        fits = [a for a in live if _window(a) >= need] or live
        if not fits:
            chosen = next(iter(self.members.values()))
        elif self.policy == "round-robin":
            chosen = fits[next(self._turns) % len(fits)]
        else:
            placed = self._placed_counts()
            load = {id(a): max(_load(a), placed.get(id(a.scheduler), 0)) for a in fits}
            if self.policy == "least-loaded":
                chosen = min(fits, key=lambda a: load[id(a)])
            else:
                roomy = [a for a in fits if _kv_use(a) < self.pool_high] or fits
                chosen = min(roomy, key=lambda a: (load[id(a)] / _lanes(a), load[id(a)]))
        if job is not None:
            job.scheduler = chosen.scheduler
            self._placed.add(job)
        return chosen

    def _placed_counts(self) -> dict[int, int]:
        """Live placed jobs by the scheduler that holds them now (done ones are let go)."""
        counts: dict[int, int] = {}
        for job in list(self._placed):
            if job.done:
                self._placed.discard(job)
            else:
                counts[id(job.scheduler)] = counts.get(id(job.scheduler), 0) + 1
        return counts

    def up(self) -> None:
        """A node's link serves again: the others look at once whether they have work to shed."""
        for actor in self.members.values():
            actor.scheduler.ring()

    def shed(self, source: Scheduler) -> None:
        """``source``'s node is gone: what waits there goes to the nodes that are up (none up:
        it stays, for the first node back)."""
        targets = [a for a in self.live() if a.scheduler is not source]
        if not targets:
            return
        for item in source.evacuate():
            prompt = getattr(item, "prompt", None)
            need = len(prompt) + len(item.tokens) if prompt is not None else 0
            self.place(need, among=targets).scheduler.adopt([item])

    def describe(self) -> list[dict[str, Any]]:
        """Per node: up, lanes, load, KV use, window (``/v1/models``, ``/metrics``, the monitor)."""
        return [{"node": ident, "up": self.is_up(a), "lanes": _lanes(a), "load": _load(a),
                 "kv_use": round(_kv_use(a), 3), "n_ctx": _window(a)} for ident, a in self.members.items()]
