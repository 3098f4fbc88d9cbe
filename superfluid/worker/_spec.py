"""Speculative decoding by prompt lookup, and the gates that decide where it runs.

Drafting: a lane's draft is the tokens that followed the last earlier
occurrence of its last three tokens, else of its last two (:class:`Lookup`,
an incremental n-gram index over the lane's prompt and output).

Verification (in the executor): a speculating lane's decode row carries its
pending token and the draft, with logits at every position. The executor
draws position ``i``'s token exactly as plain decoding would draw generated
token ``k + i`` (same sampler, same counter seed, penalties advanced by the
tokens before it) and accepts the draft while the drawn token equals it; the
first draw that differs is kept as the correction and the rest of the row is
removed from the lane's KV. With a point-mass drafter this is the standard
speculative-sampling rule (accept ``d`` with probability ``p(d)``, else draw
from ``p`` without ``d``, renormalised) realised by coupling, so the output
is not only distributed as plain decoding's: for a given seed it is the same
text. Greedy is the special case of an argmax draw.

Gates (:class:`Gates`, one per worker; the seed document's flags):

* adaptive depth: per lane count, the draft depth with the most expected
  tokens per second (acceptance measured per draft position, round cost
  measured per depth);
* yield floor: a lane that after ``yield_rounds`` drafting rounds averages
  fewer than ``min_yield`` accepted tokens a round stops drafting; two such
  requests and none passing abandon speculation for the worker's life;
* throughput gate: per lane count, a probe alternates plain and drafting
  rounds and keeps speculation only if it is ``min_speedup`` times faster in
  tokens per second; a lane count that failed re-probes after ``reprobe``
  admissions, the interval doubling up to ``reprobe_max``.

Every time the gates read comes from ``clock`` (``time.perf_counter`` in a
worker; a virtual clock in tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from ..proto import MAX_DRAFT_DEPTH, SpecConfig

__all__ = ["PLAIN", "Gates", "LaneSpec", "Lookup"]

PLAIN = 0
EARLY_ROUNDS = 4    # probe rounds a side before a clear loss may end a probe early
EARLY_LOSS = 0.75   # drafting measured below this share of plain tokens/s after EARLY_ROUNDS: off at once


class Lookup:
    """An incremental index of a lane's 3- and 2-grams: where each last ended."""

    __slots__ = ("_ends", "_done")

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._done = 0   # n-grams ending before this position are indexed

    def draft(self, tokens: list[int], depth: int) -> list[int]:
        """Up to ``depth`` tokens that followed the last earlier occurrence of the
        last three tokens of ``tokens`` (else the last two); [] if neither recurs."""
        n = len(tokens)
        # index every n-gram that ends before the last position (the current tail is not "earlier")
        ends = self._ends
        for end in range(max(self._done, 2), n):
            ends[(tokens[end - 2], tokens[end - 1])] = end
            if end >= 3:
                ends[(tokens[end - 3], tokens[end - 2], tokens[end - 1])] = end
        self._done = max(self._done, n)
        for size in (3, 2):
            if n <= size:
                continue
            at = ends.get(tuple(tokens[n - size:]))
            if at is not None:
                return tokens[at:at + depth]
        return []


@attrs.define
class _Count:
    """One lane count's throughput verdict and what it was measured on."""

    verdict: str = "probe"         # probe | on | off
    probe: dict[str, list[float]] = attrs.field(factory=lambda: {"plain": [0, 0.0, 0.0], "spec": [0, 0.0, 0.0]})
    interval: int = 0              # admissions between re-probes after an "off"
    on_interval: int = 0           # admissions between re-probes while "on"
    wait: int = 0                  # admissions left before the next re-probe
    speedup: float = 0.0           # the last probe's drafting/plain tokens-per-second ratio
    # [rounds, seconds] per depth (0 = plain), halved past 64 rounds: the machine's load drifts
    cost: dict[int, list[float]] = attrs.field(factory=dict)

    def seconds(self, depth: int) -> float | None:
        got = self.cost.get(depth)
        return got[1] / got[0] if got and got[0] >= 2 else None


@attrs.define(eq=False)
class LaneSpec:
    """One lane's drafting state."""

    lookup: Lookup = attrs.field(factory=Lookup)
    rounds: int = 0        # rounds it drafted in
    proposed: int = 0
    accepted: int = 0
    stopped: bool = False  # the yield floor stopped its drafts
    judged: bool = False


class Gates:
    def __init__(self, config: SpecConfig, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.clock = clock
        self.counts: dict[int, _Count] = {}
        self.abandoned = False
        self.failing = 0       # requests the yield floor stopped
        self.passing = 0       # requests that met it
        # acceptance per draft position (1-based): [drafted, accepted]
        self.positions = [[0, 0] for _ in range(MAX_DRAFT_DEPTH + 1)]
        self.totals = {"proposed": 0, "accepted": 0, "rounds": 0, "plain_rounds": 0}
        self._flip = 0
        self._explore = 0
        self._judged: set[int] = set()   # lane counts the gate has seen

    # -- per lane ---------------------------------------------------------------

    def wants(self, lane: LaneSpec) -> bool:
        return not (self.abandoned or lane.stopped)

    def judge(self, lane: LaneSpec) -> None:
        """The yield floor, after a lane's drafting round."""
        c = self.config
        if lane.judged or lane.rounds < c.yield_rounds:
            return
        lane.judged = True
        if lane.accepted / lane.rounds < c.min_yield:
            lane.stopped = True
            self.failing += 1
            if self.failing >= 2 and not self.passing:
                self.abandoned = True
        else:
            self.passing += 1

    def drafted(self, proposed: int, accepted: int) -> None:
        """A lane's draft of ``proposed`` tokens had its first ``accepted`` accepted."""
        self.totals["proposed"] += proposed
        self.totals["accepted"] += accepted
        for i in range(1, proposed + 1):
            self.positions[i][0] += 1
            if i <= accepted:
                self.positions[i][1] += 1
            if i > accepted:
                break   # later positions were never judged

    # -- per round --------------------------------------------------------------

    def depth(self, n_lanes: int) -> int:
        """The draft depth for a decode round of ``n_lanes`` lanes; 0 = decode plainly."""
        if self.abandoned:
            return PLAIN
        count = self.counts.setdefault(n_lanes, _Count())
        if self.config.throughput_gate:
            if n_lanes not in self._judged:
                self._judged.add(n_lanes)
                low = [m for m, c in self.counts.items() if m < n_lanes and c.verdict == "off"]
                if low and count.verdict == "probe":
                    # a smaller lane count failed: this one starts off, on the same re-probe schedule
                    was = self.counts[max(low)]
                    count.verdict, count.speedup, count.interval, count.wait = (
                        "off", was.speedup, was.interval, was.wait)
            if count.verdict == "off":
                return PLAIN
            if count.verdict == "probe":
                # alternate: the side with fewer probe rounds goes next (plain first)
                plain, spec = count.probe["plain"][0], count.probe["spec"][0]
                if plain < spec or (plain == spec and not self._flip):
                    self._flip ^= 1
                    return PLAIN
                self._flip ^= 1
        return self._best_depth(count)

    def _best_depth(self, count: _Count) -> int:
        top = self.config.depth
        if not self.config.adaptive:
            return top
        plain = count.seconds(PLAIN)
        best, best_rate = top, -1.0
        for d in range(1, top + 1):
            seconds = count.seconds(d)
            if seconds is None:
                if plain is None:
                    return top
                # a prior until this depth is measured: SmolLM2 on 2 CPU cores, one lane, measured
                # 1.67x/2.03x/2.41x/2.83x of a plain round for 1-4 drafts
                seconds = plain * (1.25 + 0.4 * d)
            rate = (1.0 + self._expected_accepted(d)) / seconds
            if rate > best_rate:
                best, best_rate = d, rate
        # now and then a neighbour, so the cost of other depths stays measured
        self._explore = (self._explore + 1) % 16
        if self._explore == 0:
            return best + 1 if best < top else max(1, best - 1)
        return best

    def _expected_accepted(self, depth: int) -> float:
        """Expected accepted drafts of a ``depth``-token draft, from measured per-position rates
        (an unmeasured position assumes the last measured rate, or 0.5)."""
        total, through, rate = 0.0, 1.0, 0.5
        for i in range(1, depth + 1):
            drafted, accepted = self.positions[i]
            if drafted >= 8:
                rate = accepted / drafted
            through *= rate
            total += through
        return total

    def record(self, n_lanes: int, depth: int, tokens: int, seconds: float) -> None:
        """A decode round of ``n_lanes`` lanes at ``depth`` (0 = plain) produced ``tokens`` in ``seconds``."""
        count = self.counts.setdefault(n_lanes, _Count())
        self.totals["rounds" if depth else "plain_rounds"] += 1
        cost = count.cost.setdefault(depth, [0.0, 0.0])
        cost[0] += 1
        cost[1] += seconds
        if cost[0] > 64:
            cost[0], cost[1] = cost[0] / 2, cost[1] / 2
        if count.verdict != "probe" or not self.config.throughput_gate:
            return
        side = count.probe["plain" if depth == PLAIN else "spec"]
        side[0] += 1
        side[1] += tokens
        side[2] += seconds
        plain, spec = count.probe["plain"], count.probe["spec"]
        done = min(plain[0], spec[0])
        if done < min(EARLY_ROUNDS, self.config.probe_rounds):
            return
        plain_rate = plain[1] / plain[2] if plain[2] > 0 else 0.0
        spec_rate = spec[1] / spec[2] if spec[2] > 0 else 0.0
        speedup = spec_rate / plain_rate if plain_rate else 0.0
        # a clear loss is called early: a probe's drafting rounds are what the gate exists to avoid
        if done < self.config.probe_rounds and speedup >= EARLY_LOSS:
            return
        count.speedup = speedup
        count.probe = _Count().probe
        if speedup >= self.config.min_speedup:
            # a workload that paid may give way to one that does not: "on" is measured again too,
            # less and less often while it holds
            count.on_interval = min(self.config.reprobe_max, 2 * count.on_interval if count.on_interval else
                                    self.config.reprobe)
            count.verdict, count.wait = "on", count.on_interval
            return
        # speculation pays less the more lanes share a round: larger counts fail with this one
        for n, other in self.counts.items():
            if n >= n_lanes and (other is count or other.verdict != "off"):
                other.verdict = "off"
                other.speedup = other.speedup if other is not count and other.speedup else speedup
                other.interval = min(self.config.reprobe_max, 2 * other.interval if other.interval else
                                     self.config.reprobe)
                other.wait = other.interval

    def admitted(self) -> None:
        """One admission: judged lane counts count down to their re-probe."""
        for count in self.counts.values():
            if count.verdict in ("off", "on"):
                count.wait -= 1
                if count.wait <= 0:
                    count.verdict = "probe"

    def snapshot(self) -> dict[str, Any]:
        """What /metrics shows: totals, and per lane count the verdict and the last measured speedup."""
        return {"abandoned": self.abandoned, **self.totals,
                "counts": {n: [c.verdict, round(c.speedup, 3)] for n, c in sorted(self.counts.items())}}
