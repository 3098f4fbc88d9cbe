"""The generic executor: lanes, continuous batching and the prefix cache.

It is written once, over the primitive :class:`Engine` API, and used by every
primitive runtime. It is synchronous and single-threaded: the worker's engine
task calls :meth:`Executor.step` from a worker thread, and applies admits and
cancels only between steps.

Invariants (checked by tests with the mock engine, which refuses any decode
whose positions do not continue its sequence):

* A lane's KV sequence holds exactly ``lane.tokens[:lane.n_past]``.
* A lane is *ready to sample* when every token it has was decoded; the step
  that decodes its last pending token samples its next token in the same step.
* Every KV sequence is owned by at most one lane; a sequence no lane owns is a
  prefix-cache entry described by ``Executor.slots[seq]`` (its token ids).
* A cached sequence about to be overwritten is exported to the host cache
  (:mod:`._hostcache`) when it is long and held nowhere else; an admission
  imports a host entry when it covers more of the prompt than any sequence.
* Every sequence and host entry carries the cache salt (``Admit.cache_salt``)
  it was computed under; a lane reuses, copies or imports KV only of its own
  salt, so one tenant's prompt is never a prefix hit for another.

Exact mode computes a lone lane's KV in one shape whatever came before it, so
a request sent alone gets the same logits cold, warm, after other requests and
after a restart. It is on in deterministic mode and, by default, over an engine
whose rows' results depend on the shape of the pass they are in and that keeps
one KV stream per sequence (``engine.grid``: llama.cpp per-sequence KV):

* Prompt tokens are prefilled in grid cells: chunks whose boundaries are the
  multiples of ``GRID`` absolute positions (the prompt's last cell ends at its
  end). A step takes whole cells, never a part sized by its budget, and the
  prompt's *last step* (:func:`last_step`) goes alone: the cell holding the
  last prompt token, with the full cell before it when that cell is partial
  and has one. llama.cpp computes a short last cell in other kernels alone
  than inside a bigger micro-batch, so its shape must not depend on what was
  reused; and a step of at least ``GRID`` query rows takes flash attention's
  tiled kernel (against a 5,204-token KV on 2 cores: the 20-row last cell alone
  2.3 s, the 84-row last step 1.2 s, one token alone 0.11 s; measured together,
  bench-results/35bae36/).
* Tokens after ``n_prompt`` (a resumed lane's committed tokens) are replayed
  one per decode round, as they were first computed, not prefilled (not while
  speculating: a drafting round computes several at once anyway).
* A lane reuses (or copies, or imports) only whole grid cells of an earlier
  prompt, and none of its own prompt's last step (so a warm lane computes that
  step in the cold lane's shape); a finished lane's KV is kept only up to its
  last whole prompt cell (the full cell inside its last step included: whole
  cells give the same rows whatever number of cells shares their pass)
  (a shared pool, which cannot drop a suffix, keeps none), so a follow-up turn
  prefills the previous reply again (decoded one token a pass, its KV differs
  from a prefill's).

Deterministic mode (``deterministic=True``) also makes a lane's logits
independent of the other lanes beside it (on a runtime whose rows do not depend
on the other rows of a batch; see ``LlamaEngine``): each step takes one cell of
each prompt, its last (partial) cell alone as in any other step (flash attention
is off there, so no short step is slow), and every sequence is asked at
admission (whole-cell matches, up to the last cell).
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import heapq
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from ..chat import StopScan
from ..proto import SLOT_FILE, Admit, Sampling
from ._engine import BatchRow, Engine, LaneSampler, StepAborted
from ._hostcache import HOST_MIN_TOKENS, HostCache, common_prefix
from ._park import ParkRefused, ParkStore
from ._prefix import BLOCK, BlockIndex, chain
from ..proto import SpecConfig
from ._spec import PLAIN, Gates, LaneSpec

__all__ = ["Executor", "Lane", "StepResult", "last_step"]

PREFILL_CHUNK = 512
MIN_COPY = 4    # a prefix this long elsewhere is copied in (a copy costs about 3 prompt tokens of prefill)
DEMOTE_MIN = 256  # a cached prefix this long moves to a spare sequence rather than be overwritten
# a sequence this short is copied by state export/import (cost grows with its length: 143 tokens
# 3.1 ms on SmolLM2) rather than seq_cp, which copies the whole per-sequence stream (~9 ms at 4,096 cells)
STATE_COPY_MAX = 384
PARK_GAIN = 64  # a parked artifact is read only when it covers this many more prompt tokens than the cache
GRID = 64       # exact mode: prompt prefill chunk boundaries are the multiples of this position
TAIL_BYTES = 64 << 20   # exact mode: the kept last-step logits, all sequences together (oldest dropped)


@attrs.define(eq=False)
class Lane:
    lane: int
    seq: int
    tokens: list[int]
    n_prompt: int
    max_new: int
    sampling: Sampling
    ignore_eos: bool
    sampler: LaneSampler
    priority: int = 2
    n_past: int = 0
    cached: int = 0
    replay: bool = False   # exact mode: tokens after the prompt are decoded one per round
    spec: LaneSpec | None = None   # drafting state, if this lane may speculate
    stops: StopScan | None = None  # its stop strings over what it generated (Admit.stops)
    # exact mode: the logits its prompt's last step gave (kept with its KV when it ends: a tail)
    tail: Any = attrs.field(default=None, repr=False)
    # the logits its first token is drawn from with no pass (admitted on a tail hit, not drawn yet)
    primed: Any = attrs.field(default=None, repr=False)

    @property
    def prefill_end(self) -> int:
        """Tokens up to here are prefilled in chunks; later ones decode one per round."""
        return self.n_prompt if self.replay else len(self.tokens)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.n_past

    @property
    def prefilling(self) -> bool:
        return self.prefill_end - self.n_past > 1

    @property
    def decoding(self) -> bool:
        """The next step for this lane is a one-token decode row (or, primed, a draw with no row)."""
        return not self.prefilling and (self.pending >= 1 or self.primed is not None)


@attrs.define
class StepResult:
    emits: list[list[Any]] = attrs.field(factory=list)
    faults: list[tuple[int, str]] = attrs.field(factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    aborted: bool = False   # the step stopped midway for a more urgent arrival: nothing advanced


@attrs.define(eq=False)
class _Slot:
    held: list[int] = attrs.field(factory=list)     # what the sequence's KV holds while no lane owns it
    owner: int | None = None                         # lane tag, or None if cached/free
    lane: Lane | None = None                         # the owner: its KV holds lane.tokens[:lane.n_past]
    last_use: int = 0
    salt: str = ""                                   # the cache partition its KV was computed under
    exact: int = 1 << 62                             # exact mode: leading tokens in whole prompt cells
    tail: Any = None                                 # exact mode: ``held`` is one whole prompt and these
                                                     # are the logits its last step gave (a tail hit)

    @property
    def tokens(self) -> list[int]:
        """What the sequence's KV holds (a copy while a lane owns it: read it rarely)."""
        return self.lane.tokens[: self.lane.n_past] if self.lane is not None else self.held

    @property
    def size(self) -> int:
        return self.lane.n_past if self.lane is not None else len(self.held)

    def view(self) -> tuple[list[int], int]:
        """(a list whose first ``n`` tokens are what the KV holds, ``n``), without a copy."""
        return (self.lane.tokens, self.lane.n_past) if self.lane is not None else (self.held, len(self.held))


class _WindowMax:
    """The largest of the last ``size`` values pushed, in O(1) amortized a push."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._n = 0
        self._q: collections.deque[tuple[int, int]] = collections.deque()   # (push number, value), values falling

    def push(self, value: int) -> int:
        q = self._q
        while q and q[-1][1] <= value:
            q.pop()
        q.append((self._n, value))
        if q[0][0] <= self._n - self.size:
            q.popleft()
        self._n += 1
        return q[0][1]


def last_step(end: int) -> int:
    """Exact mode: where the last prefill step of a prompt ending at ``end`` starts.

    It holds the cell holding the last prompt token and, when that cell is
    partial and has a full cell before it, that cell too: ``GRID + r`` rows
    (``r = end % GRID``) rather than ``r`` alone, so the step takes flash
    attention's tiled kernel. A full last cell, or a one-cell prompt, is a
    step alone. A lane reuses no token at or past this position.
    """
    last = (end - 1) // GRID * GRID
    return last - GRID if end % GRID and last >= GRID else last


def counter_seed(seed: int, k: int) -> int:
    """The RNG seed for generated token ``k`` of a lane seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class Executor:
    def __init__(self, engine: Engine, *, max_lanes: int, host_cache_bytes: int = 0,
                 deterministic: bool = False, speculate: SpecConfig | None = None,
                 clock: Callable[[], float] | None = None, park: ParkStore | None = None) -> None:
        self.engine = engine
        self.deterministic = deterministic
        self.info = engine.info
        self.max_lanes = max(1, min(max_lanes, engine.info.n_seq))
        self.slots = [_Slot() for _ in range(engine.info.n_seq)]
        self.lanes: dict[int, Lane] = {}
        self.shared = engine.info.kv_layout != "per_seq"
        # exact mode (see the module docstring): a lone lane's KV in one shape whatever came before
        self.exact = deterministic or (bool(getattr(engine, "grid", False)) and not self.shared)
        self.aborts = bool(getattr(engine, "aborts", False))   # the engine can stop a pass midway
        # an aborting engine's prefill step: its batch, which it runs as micro-batches (llama.cpp)
        self.abortable_step = max(PREFILL_CHUNK, int(engine.info.extra.get("n_batch", 0)))
        # cells in the KV pool: one buffer per sequence, or one shared pool
        self.pool_cells = int(engine.info.extra.get("n_ctx", 0)) or engine.info.n_seq * engine.info.n_ctx_seq
        self._last_step_decoded = True
        self._clock = 0
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "cached_tokens": 0, "steps": 0, "aborted": 0, "demoted": 0,
                      "state_copies": 0}
        self.host = HostCache(host_cache_bytes)
        self.park = park   # --park: finished sequences on disk (_park.py)
        self._timer = time.perf_counter
        self._recent_live = _WindowMax(2 * self.max_lanes)
        # per-sequence KV: free sequences in order, and the prefix index admissions search
        # (deterministic mode's whole-cell matches keep the plain scan)
        self._free: list[int] = list(range(len(self.slots)))
        self._free_set: set[int] = set(self._free)
        self._live: set[int] = set()
        self.index = None if self.shared or deterministic else BlockIndex(len(self.slots))
        # free sequences by (holds tokens, last use): the demotion's spare is the smallest; entries
        # go stale when the sequence changes and are dropped when met (a rebuild bounds the heap)
        self._spare_heap: list[tuple[bool, int, int]] = [(False, 0, i) for i in range(len(self.slots))]
        # prompt-lookup speculation (worker/_spec.py); the caller has checked the engine drafts
        if speculate is not None and (deterministic or engine.drafts is not True):
            raise ValueError("prompt-lookup needs a non-deterministic executor over an engine that drafts")
        self.gates = None if speculate is None else Gates(speculate, *([clock] if clock else []))
        # exact mode over one KV stream per sequence: a finished prompt's last-step logits, kept
        # with its whole KV so the same prompt again draws its first token with no pass (a tail
        # hit); seq -> bytes, oldest first, within TAIL_BYTES
        keep = getattr(engine, "keep_logits", None)
        self._keep: Callable[[Any], Any] | None = keep if self.exact and not self.shared else None
        self._tails: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._tail_bytes = 0
        self._primed: list[int] = []   # lanes admitted on a tail hit, their first draw not made

    # -- lanes ---------------------------------------------------------------

    def admit(self, msg: Admit) -> Lane:
        """Open a lane, seeding its KV from the best prefix-cache match.

        Raises:
            ValueError: no free sequence, the lane exceeds the context window,
                or the sampling request is invalid.
        """
        if msg.lane in self.lanes:
            raise ValueError(f"lane {msg.lane} is already open")
        if len(self.lanes) >= self.max_lanes:
            raise ValueError(f"all {self.max_lanes} lanes are busy")
        tokens = list(msg.tokens)
        if len(tokens) >= self.info.n_ctx_seq:
            raise ValueError(f"{len(tokens)} tokens do not fit the {self.info.n_ctx_seq}-token window")
        replay = self.exact and self.gates is None
        # the same whole prompt again, its KV and last-step logits kept: nothing to compute
        hit = self._tail_hit(tokens, msg.n_prompt, msg.cache_salt) if replay or len(tokens) == msg.n_prompt else None
        if hit is None:
            tail = None
            seq, matched, src = self._pick_slot(tokens, msg.cache_salt)
            # exact mode reuses nothing of the prompt's last step, so a warm lane computes it in the
            # cold one's shape (deterministic mode's whole-cell matches stop before its last cell,
            # its last step)
            grid_steps = self.exact and not self.deterministic
            reuse = last_step(msg.n_prompt if replay else len(tokens)) if grid_steps else len(tokens) - 1
            if grid_steps:
                matched, src = self._whole_cells(tokens, msg.cache_salt, seq, matched, src, reuse)
        else:
            seq, matched, src = hit, msg.n_prompt, None
            tail = self.slots[hit].tail
            self._recent_live.push(len(self._live))   # (as _pick_slot counts every admission)
        slot = self.slots[seq]
        sampler = self.engine.new_sampler(self._lane_sampling(msg), tokens[msg.n_prompt:])
        if hit is None:
            self._preserve(seq, keep=0 if src is not None else matched, src=src)
            imported = self._import(seq, tokens, msg.cache_salt, better_than=matched, limit=reuse)
            if imported is None and self.park is not None:
                imported = self._restore(seq, tokens, msg.cache_salt, better_than=matched, limit=reuse)
            if imported is not None:
                matched = imported
            elif src is not None and src != seq:
                self._copy(src, seq, matched)
            elif matched < slot.size:
                if not self.engine.seq_rm(seq, matched, -1):
                    self.engine.seq_rm(seq, 0, -1)
                    matched = 0
        slot.held = []
        slot.salt = msg.cache_salt
        if self.index is not None:
            self.index.set(seq, tokens, matched, msg.cache_salt)
        slot.exact = self._cells(msg.n_prompt) if self.exact else _Slot.exact
        lane = Lane(
            lane=msg.lane, seq=seq, tokens=tokens, n_prompt=msg.n_prompt, max_new=msg.max_new,
            sampling=self._capped(msg.sampling), ignore_eos=msg.ignore_eos, sampler=sampler, priority=msg.priority,
            n_past=matched,
            cached=min(matched, msg.n_prompt), replay=replay,
            spec=LaneSpec() if self._may_draft(self._capped(msg.sampling)) else None, stops=self._stop_scan(msg),
            tail=tail, primed=tail if tail is not None and len(tokens) == msg.n_prompt else None,
        )
        if lane.primed is not None:
            self._primed.append(msg.lane)
        if self.gates is not None:
            self.gates.admitted()
        self._own(seq, msg.lane, lane)
        self.lanes[msg.lane] = lane
        self.stats["cached_tokens"] += lane.cached
        return lane

    def _may_draft(self, s: Sampling) -> bool:
        """Grammar, ``logit_bias`` and logprobs lanes never speculate, nor ones sampling
        hotter than ``--spec-max-temperature`` (a temperature the request set: a default
        one was capped to it, :meth:`_capped`)."""
        if self.gates is None or s.grammar or s.logit_bias or s.n_logprobs >= 0:
            return False
        cap = self.gates.config.max_temperature
        return cap < 0 or s.temperature <= cap

    def _pick_slot(self, tokens: list[int], salt: str = "") -> tuple[int, int, int | None]:
        """Choose a free sequence for ``tokens``: (seq, tokens reusable, source seq).
        Only sequences computed under ``salt`` count as matches.

        Per-sequence layout: llama.cpp's per-sequence KV costs grow with the
        span of sequence ids in a batch (lanes on 0,5,7,9 decode about 1.5x
        slower than on 0,1,2,3), so the new lane takes the best-matching free
        sequence among those that keep the live span within the lanes expected
        at once (the most live at any of the last ``2 * max_lanes``
        admissions, plus one), or smallest if it is already wider. So a wave of
        requests on prompts seen before goes back to the sequences holding
        them, while lanes still pack as tightly as the load needs. A prefix at
        least ``MIN_COPY`` tokens longer elsewhere (cached or live) is copied
        in. Shared pool: the best whole cached sequence, else the least
        recently used one.
        """
        limit = len(tokens) - 1  # always decode at least one token for logits
        if self.info.kv_layout == "per_seq":
            if not self._free:
                raise ValueError("no free KV sequence")
            recent = self._recent_live.push(len(self._live))
            picked = self._pick_indexed(tokens, limit, salt, recent) if self.index is not None else None
            if picked is None:
                picked = self._pick_scan(tokens, limit, salt, recent)
            return self._onto_empty(*picked, tokens=tokens, limit=limit, recent=recent)
        best_free: tuple[int, int] | None = None   # (tokens reusable, -last_use)
        free_seq = -1
        for i, slot in enumerate(self.slots):
            if slot.owner is None:
                n = self._reusable(slot, tokens, limit, salt)
                if n < len(slot.tokens):
                    n = 0  # a shared pool reuses a cached sequence only whole
                key = (n, -slot.last_use)
                if best_free is None or key > best_free:
                    best_free, free_seq = key, i
        if best_free is None:
            raise ValueError("no free KV sequence")
        return free_seq, best_free[0], None

    def _onto_empty(self, seq: int, matched: int, src: int | None, *, tokens: list[int], limit: int,
                    recent: int) -> tuple[int, int, int | None]:
        """A pick that would overwrite another prompt's cached tokens (held nowhere else) goes
        to an empty free sequence instead, when one is in the live span's reach (no wider than
        the pick's or the recent load's), its reusable prefix copied in from where it is. So
        lone requests on different prompts each keep their own sequence while empty ones
        remain, as a peer's slots keep theirs (one sequence rewritten by each kept only the
        last), at a copy's cost (``MIN_COPY``) and never a wider decode span than the load
        needs. The same prompt again, or one continuing what the sequence holds, stays."""
        slot = self.slots[seq]
        held, size = slot.view()
        if src is None and common_prefix(held, tokens, min(limit, size)) >= min(limit, size):
            return seq, matched, src
        if self._held_elsewhere(seq):
            return seq, matched, src
        empty = self._spare(seq, src)
        if empty is None or self.slots[empty].held:
            return seq, matched, src
        if self._live:
            lo, hi = min(self._live), max(self._live)

            def span(i: int) -> int:
                return max(hi, i) - min(lo, i) + 1
            if span(empty) > max(span(seq), 1 + recent):
                return seq, matched, src
        if src is not None:
            return empty, matched, src
        return (empty, matched, seq) if matched >= MIN_COPY else (empty, 0, None)

    def _pick_scan(self, tokens: list[int], limit: int, salt: str, recent: int) -> tuple[int, int, int | None]:
        """``_pick_slot`` by asking every sequence (the rule's plain statement;
        deterministic mode, and the index's fallback when hashes collided)."""
        free = [i for i, slot in enumerate(self.slots) if slot.owner is None]
        live = [i for i, slot in enumerate(self.slots) if slot.owner is not None]
        matches = [self._reusable(slot, tokens, limit, salt) for slot in self.slots]
        # A wider span costs every decode round (~2 ms per extra sequence at 4 lanes), a
        # copy of a better match once (0.4-10 ms, by its length and the machine's load)
        # the span with i added, from the live span's ends (a span per free sequence over
        # every live one was a quarter of the worker's time admitting at 256 lanes)
        lo, hi = (min(live), max(live)) if live else (None, None)
        spans = {i: 1 if lo is None else max(hi, i) - min(lo, i) + 1 for i in free}
        bound = max(min(spans.values()), 1 + recent)
        allowed = [i for i in free if spans[i] <= bound]
        target = max(allowed, key=lambda i: (matches[i], -spans[i], -i))
        best = max(range(len(self.slots)), key=lambda i: (matches[i], i == target))
        if best != target and matches[best] - matches[target] >= MIN_COPY:
            return target, matches[best], best
        return target, matches[target], None

    def _pick_indexed(self, tokens: list[int], limit: int, salt: str,
                      recent: int) -> tuple[int, int, int | None] | None:
        """``_pick_scan``'s choice from the prefix index (``_prefix.py``): only the
        sequences at the deepest block level a free one reaches are compared, so an
        admission costs about its prompt's length, not the number of sequences.
        None if a hash collision made the index's answer wrong (the caller scans)."""
        fs, index = self._free, self.index
        assert index is not None
        if self._live:
            lo, hi = min(self._live), max(self._live)
            j = bisect.bisect_left(fs, lo)
            if j < len(fs) and fs[j] <= hi:
                min_span = hi - lo + 1
            else:
                min_span = min(hi - fs[j - 1] + 1 if j else 1 << 62, fs[j] - lo + 1 if j < len(fs) else 1 << 62)
            bound = max(min_span, 1 + recent)
            # span(i) <= bound exactly for i in [hi - bound + 1, lo + bound - 1]
            allowed = fs[bisect.bisect_left(fs, hi - bound + 1):bisect.bisect_right(fs, lo + bound - 1)]

            def span(i: int) -> int:
                return hi - lo + 1 if lo <= i <= hi else (hi - i + 1 if i < lo else i - lo + 1)
        else:
            lo = hi = -1
            allowed = fs

            def span(i: int) -> int:
                return 1
        within = self._free_set if len(allowed) == len(fs) else set(allowed)

        def first(cands: set[int] | list[int]) -> int:
            """The candidate the rule prefers at equal matches: smallest span, then number
            (inside the live span every span is the same; outside it grows with the distance)."""
            order = allowed if len(cands) == len(allowed) else sorted(cands)
            if lo < 0:
                return order[0]
            j = bisect.bisect_left(order, lo)
            if j < len(order) and order[j] <= hi:
                return order[j]
            below = order[j - 1] if j else None
            above = order[j] if j < len(order) else None
            if below is None or (above is not None and span(above) < span(below)):
                assert above is not None
                return above
            return below

        def match(i: int, start: int) -> int:
            a, n = self.slots[i].view()
            return common_prefix(a, tokens, min(limit, n), start)

        def verified(i: int, start: int) -> bool:
            a, _n = self.slots[i].view()
            return self.slots[i].salt == salt and a[:start] == tokens[:start]

        q = chain(tokens, limit // BLOCK, salt)
        salted = index.salted(salt)
        level = 0
        if salted.isdisjoint(within):
            target, m_target = first(allowed), 0   # no allowed sequence shares the salt
        else:
            level = index.deepest(q, 0, within)
            start = level * BLOCK
            cands = (index.members(q[level - 1]) if level else salted) & within
            cap = limit if level == len(q) else min(limit, start + BLOCK - 1)
            target = first(cands)
            m_target = match(target, start)
            if m_target < cap:
                m_target, _s, neg = max((match(i, start), -span(i), -i) for i in cands)
                target = -neg
            if not verified(target, start):
                return None
            if m_target == 0:
                target = first(allowed)   # nothing of the prompt is held where allowed: the tie-break decides
        if not salted:
            return target, m_target, None
        # a copy source: a sequence (free or a live lane's) holding MIN_COPY more tokens; (a
        # collision at the top level can hide one, which costs a copy's saving, never a wrong reuse)
        top = index.deepest(q, level)
        top_start = top * BLOCK
        top_cap = limit if top == len(q) else min(limit, top_start + BLOCK - 1)
        if top_cap - m_target < MIN_COPY:
            return target, m_target, None
        members = index.members(q[top - 1]) if top else salted
        best, m_best = target, m_target
        for i in sorted(members):
            m = match(i, top_start)
            if m > m_best:
                best, m_best = i, m
        if best == target or m_best - m_target < MIN_COPY:
            return target, m_target, None
        if not verified(best, top_start):
            return None
        return target, m_best, best

    def _cells(self, n: int) -> int:
        """``n`` rounded down to whole grid cells."""
        return n // GRID * GRID

    # -- tails: a whole prompt's KV and its last-step logits ---------------------------

    def _tail_hit(self, tokens: list[int], n_prompt: int, salt: str) -> int | None:
        """Exact mode: the free sequence holding exactly ``tokens[:n_prompt]`` under ``salt``
        with the logits its last step gave (newest first), or None. That KV and those logits
        are what a cold lane computes for this prompt (its cells and last step in their one
        shape), so a lane seeded from them draws what the cold lane draws."""
        if not self._tails or not n_prompt:
            return None
        last = tokens[n_prompt - 1]
        for seq in reversed(self._tails):
            slot = self.slots[seq]
            held = slot.held
            if (len(held) == n_prompt and held[-1] == last and slot.salt == salt and slot.owner is None
                    and held == tokens[:n_prompt]):
                return seq
        return None

    def _set_tail(self, seq: int, logits: Any) -> None:
        """``seq``'s kept last-step logits are now ``logits`` (None: it has none); the oldest
        others go while all of them pass ``TAIL_BYTES``."""
        size = self._tails.pop(seq, None)
        if size is not None:
            self._tail_bytes -= size
        self.slots[seq].tail = logits
        if logits is None:
            return
        size = int(getattr(logits, "nbytes", 1))
        self._tails[seq] = size
        self._tail_bytes += size
        while self._tail_bytes > TAIL_BYTES and len(self._tails) > 1:
            old, size = self._tails.popitem(last=False)
            self.slots[old].tail = None
            self._tail_bytes -= size

    def _whole_cells(self, tokens: list[int], salt: str, seq: int, matched: int,
                     src: int | None, limit: int) -> tuple[int, int | None]:
        """Exact mode over the prefix index: the pick's reuse cut back to the whole
        prompt cells its source holds, and to ``limit`` (the start of the new prompt's
        last step); a copy only while it still brings ``MIN_COPY`` more. Returns
        (tokens reusable, source seq)."""
        slot = self.slots[seq]
        raw = matched if src is None else self._reusable(slot, tokens, len(tokens) - 1, salt)
        own = min(self._cells(min(raw, slot.exact)), limit)
        if src is None:
            return own, None
        copied = min(self._cells(min(matched, self.slots[src].exact)), limit)
        return (copied, src) if copied - own >= MIN_COPY else (own, None)

    def _reusable(self, slot: _Slot, tokens: list[int], limit: int, salt: str) -> int:
        """How many of ``tokens`` (at most ``limit``) ``slot``'s KV can seed: its
        common prefix, under the same salt; in deterministic mode whole cells
        its own prompt filled."""
        if slot.salt != salt:
            return 0
        held, size = slot.view()
        n = common_prefix(held, tokens, min(limit, size))
        return self._cells(min(n, slot.exact)) if self.deterministic else n

    # -- keeping what a new lane overwrites ------------------------------------------

    def _preserve(self, seq: int, *, keep: int, src: int | None) -> None:
        """``seq``'s cached tokens past ``keep`` are about to be overwritten.

        Per-sequence KV keeps compact placement from eating the cache: at
        least ``DEMOTE_MIN`` tokens held nowhere else move to a free sequence
        that is empty or least recently used, if older than them (one deferred
        whole-stream copy, a few ms inside the next decode), and what that
        spare held goes to the host cache if it is worth it. Otherwise (shared pool, no spare) the
        sequence itself goes to the host cache if it is worth it.
        """
        slot = self.slots[seq]
        if len(slot.tokens) - keep <= 0 or self._held_elsewhere(seq):
            return
        if not self.shared and len(slot.tokens) - keep >= DEMOTE_MIN:
            slots = self.slots
            spare = self._spare(seq, src)
            if spare is not None and (not slots[spare].held or slots[spare].last_use < slot.last_use):
                self._spill(spare, keep=0)
                self.engine.seq_rm(spare, 0, -1)
                self.engine.seq_cp(seq, spare, 0, -1)
                slots[spare].held, slots[spare].last_use = list(slot.held), slot.last_use
                slots[spare].salt = slot.salt
                slots[spare].exact = slot.exact
                self._set_tail(spare, slot.tail)   # the whole stream was copied: the same KV
                if self.index is not None:
                    self.index.copy(seq, spare)
                self._note_free(spare)
                self.stats["demoted"] += 1
                return
        self._spill(seq, keep=keep)

    def _spare_key(self, seq: int) -> tuple[bool, int, int]:
        """Where free ``seq`` stands as a spare: empty ones first, the lowest number first (an
        empty sequence's last use says nothing, and low numbers keep lanes packed), then the
        least recently used."""
        s = self.slots[seq]
        return (True, s.last_use, seq) if s.held else (False, 0, seq)

    def _spare(self, seq: int, src: int | None) -> int | None:
        """The free sequence other than ``seq`` and ``src`` that is empty (the lowest
        number), else least recently used (ties: the lowest number); None if there is none."""
        heap = self._spare_heap
        skipped = []
        found = None
        while heap:
            i = heap[0][2]
            if self.slots[i].owner is not None or self._spare_key(i) != heap[0]:
                heapq.heappop(heap)   # stale: the sequence changed since
            elif i == seq or i == src:
                skipped.append(heapq.heappop(heap))
            else:
                found = i
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _note_free(self, seq: int) -> None:
        """Free ``seq``'s (holds tokens, last use) changed: a new heap entry."""
        if self.shared:
            return
        heapq.heappush(self._spare_heap, self._spare_key(seq))
        if len(self._spare_heap) > 4 * len(self.slots) + 64:
            self._spare_heap = [self._spare_key(i) for i in self._free]
            heapq.heapify(self._spare_heap)

    def _copy(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold ``src``'s first ``n`` tokens (per-sequence KV)."""
        self.engine.seq_rm(dst, 0, -1)
        held = self.slots[src].size
        if held <= STATE_COPY_MAX:
            data = self.engine.seq_export(src)
            if data and self.engine.seq_import(dst, data):
                if n < held:
                    self.engine.seq_rm(dst, n, -1)
                self.stats["state_copies"] += 1
                return
            self.engine.seq_rm(dst, 0, -1)
        self.engine.seq_cp(src, dst, 0, n)

    def _held_elsewhere(self, seq: int) -> bool:
        """Another sequence of the same salt holds all of ``seq``'s (free) tokens."""
        tokens, salt = self.slots[seq].held, self.slots[seq].salt
        n = len(tokens)
        if not n:
            return any(i != seq and other.salt == salt for i, other in enumerate(self.slots))
        last = tokens[-1]
        others: Iterable[int] = range(len(self.slots))
        if self.index is not None:
            # only the sequences sharing seq's whole blocks can hold it all
            k = n // BLOCK
            others = self.index.members(self.index.chain_of(seq)[k - 1]) if k else self.index.salted(salt)
        # the length and the last token first: most sequences differ there, at no slice's cost
        for i in others:
            if i == seq:
                continue
            other, size = self.slots[i].view()
            if size >= n and other[n - 1] == last and self.slots[i].salt == salt and common_prefix(other, tokens, n) == n:
                return True
        return False

    def _spill(self, seq: int, *, keep: int) -> None:
        """``seq``'s cached tokens past ``keep`` are about to be overwritten:
        export the sequence first if that prefix is worth keeping and no other
        sequence holds it."""
        slot = self.slots[seq]
        if len(slot.tokens) - keep < HOST_MIN_TOKENS or not self.host.wants(slot.tokens, slot.salt):
            return
        if self._held_elsewhere(seq):
            return
        data = self.engine.seq_export(seq)
        if data:
            self.host.put(slot.tokens, data, slot.salt)

    def _import(self, seq: int, tokens: list[int], salt: str, *, better_than: int, limit: int) -> int | None:
        """Seed ``seq`` from the host cache if an entry of ``salt`` covers at least
        ``HOST_MIN_TOKENS`` more of ``tokens`` (at most ``limit``) than ``better_than``.
        Returns the tokens now in ``seq`` (0 if the import failed and left it empty),
        or None if nothing was tried (``seq`` untouched)."""
        found = self.host.best(tokens, len(tokens) - 1, salt, whole=self.shared)
        if found is None:
            return None
        key, n = found
        if self.exact:
            # entries hold whole prompt cells; the prompt may part from one mid-cell, and its
            # last step is computed in one shape
            n = min(self._cells(n), limit)
        if n < better_than + HOST_MIN_TOKENS:
            return None
        entry = self.host.take(key)
        self.engine.seq_rm(seq, 0, -1)
        self._set_held(seq, [])
        self._make_room(len(entry.tokens))
        if not self.engine.seq_import(seq, entry.data):
            self.engine.seq_rm(seq, 0, -1)
            return 0
        if n < len(entry.tokens):
            self.engine.seq_rm(seq, n, -1)
        self.host.stats["hit_tokens"] += n
        return n

    def _restore(self, seq: int, tokens: list[int], salt: str, *, better_than: int, limit: int) -> int | None:
        """Seed ``seq`` from a parked artifact of ``salt`` (``_park.py``) if one covers at least
        ``PARK_GAIN`` more of ``tokens`` (at most ``limit``) than ``better_than``; the artifact is
        checked before the engine sees it. Returns the tokens now in ``seq`` (0 if the artifact
        or its import was refused, ``seq`` left empty: the lane prefills), or None if nothing
        was tried (``seq`` untouched)."""
        park = self.park
        assert park is not None
        found = park.best(tokens, len(tokens) - 1, salt, whole=self.shared)
        if found is None:
            return None
        entry, n = found
        if self.exact:
            n = min(self._cells(n), limit)   # as a host import: whole prompt cells, not the last step
        if n < better_than + PARK_GAIN:
            return None
        t0 = self._timer()
        try:
            data = park.load(entry, salt)
        except ParkRefused:
            return None
        self.engine.seq_rm(seq, 0, -1)
        self._set_held(seq, [])
        self._make_room(len(entry.tokens))
        if not self.engine.seq_import(seq, data):
            self.engine.seq_rm(seq, 0, -1)
            park.refuse(entry, "import")
            return 0
        if n < len(entry.tokens):
            self.engine.seq_rm(seq, n, -1)
        park.resumed(n, self._timer() - t0)
        return n

    def slot_action(self, action: str, seq: int, filename: str, salt: str) -> tuple[int, str, str, int, int]:
        """llama-server's slot actions on sequence ``seq`` (``SlotAction``), between steps:
        ``(status, error, message, tokens, bytes)``, status 0 when done. ``save`` writes what
        ``seq`` holds (a running lane's KV so far, else its cached tokens) under the salt it
        was computed with; ``restore`` imports a saved file into free ``seq`` for ``salt``
        (refused ``slot_foreign`` if another model, build, KV type or tenant made it);
        ``erase`` drops free ``seq``'s cached tokens."""
        if not 0 <= seq < len(self.slots):
            return 404, "slot_not_found", f"no slot {seq}: this model has {len(self.slots)}", 0, 0
        slot = self.slots[seq]
        if action == "erase":
            if slot.owner is not None:
                return 409, "slot_busy", f"slot {seq} is running a generation", 0, 0
            n = len(slot.held)
            self.engine.seq_rm(seq, 0, -1)
            self._set_held(seq, [])
            return 0, "", "", n, 0
        park = self.park
        if park is None:
            return 501, "slots_unavailable", "slot files need --park (the runtime's KV as bytes on disk)", 0, 0
        if not SLOT_FILE.fullmatch(filename) or filename in (".", ".."):
            return 400, "invalid_filename", "filename must be 1-128 of A-Z a-z 0-9 . _ -", 0, 0
        if action == "save":
            view, n = slot.view()
            tokens = list(view[:n])
            if not tokens:
                return 400, "slot_empty", f"slot {seq} holds no tokens", 0, 0
            data = _state_bytes(self.engine.seq_export(seq))
            if not data:
                return 501, "slots_unavailable", "the runtime exported no state", 0, 0
            try:
                nbytes = park.save_named(filename, tokens, slot.salt, data)
            except OSError as exc:
                return 500, "slot_write_failed", str(exc), 0, 0
            return 0, "", "", len(tokens), nbytes
        if slot.owner is not None:
            return 409, "slot_busy", f"slot {seq} is running a generation", 0, 0
        try:
            tokens, data = park.load_named(filename, salt)
        except ParkRefused as exc:
            if exc.reason == "missing":
                return 404, "slot_file_not_found", f"no slot file {filename!r}", 0, 0
            if exc.reason == "foreign":
                return 409, "slot_foreign", (f"{filename!r} was saved by another model, runtime build, "
                                             "KV type or tenant"), 0, 0
            return 400, "slot_file_invalid", f"{filename!r}: {exc}", 0, 0
        if len(tokens) >= self.info.n_ctx_seq:
            return 400, "slot_file_invalid", f"{len(tokens)} tokens do not fit the window", 0, 0
        self.engine.seq_rm(seq, 0, -1)
        self._set_held(seq, [])
        self._make_room(len(tokens))
        if not self.engine.seq_import(seq, data):
            self.engine.seq_rm(seq, 0, -1)
            return 400, "slot_file_invalid", f"the runtime refused {filename!r}", 0, 0
        slot.salt = salt
        # exact mode: whole cells only (a saved prompt may end in a partial cell, its tail)
        slot.exact = self._cells(len(tokens)) if self.exact else _Slot.exact
        self._clock += 1
        slot.last_use = self._clock
        self._set_held(seq, tokens)
        return 0, "", "", len(tokens), len(data)

    def cancel(self, lane_tag: int, *, publish: bool) -> bool:
        lane = self.lanes.pop(lane_tag, None)
        if lane is None:
            return False
        self._release(lane, publish=publish)
        return True

    def _release(self, lane: Lane, *, publish: bool, finished: bool = False) -> None:
        """Close ``lane``; with ``publish`` its sequence stays as a prefix-cache entry and, when
        the lane ``finished`` (not preempted or cancelled), may be parked (``--park``)."""
        lane.sampler.close()
        slot = self.slots[lane.seq]
        self._disown(lane.seq)
        self._clock += 1
        slot.last_use = self._clock
        keep = lane.n_past
        tail = lane.tail if publish and lane.n_past >= lane.n_prompt else None
        if publish and self.exact:
            # keep whole prompt cells only (later tokens were computed in another shape), or the
            # whole prompt with the logits its last step gave (a tail)
            keep = min(keep, slot.exact) if tail is None else lane.n_prompt
            if keep < lane.n_past and (self.shared or not self.engine.seq_rm(lane.seq, keep, -1)):
                publish = False  # a shared pool cannot drop a suffix
        self._set_tail(lane.seq, tail if publish else None)
        if publish:
            slot.held = lane.tokens[:keep]
            slot.exact = min(len(slot.held), slot.exact) if self.exact else _Slot.exact
            if finished and self.park is not None and self.park.wants(slot.held, slot.salt):
                t0 = self._timer()
                data = _state_bytes(self.engine.seq_export(lane.seq))
                self.park.exported(self._timer() - t0)
                if data:
                    self.park.put(slot.held, slot.salt, data)
        else:
            self.engine.seq_rm(lane.seq, 0, -1)
            slot.held = []
        if self.index is not None:
            self.index.truncate(lane.seq, len(slot.held))
        self._note_free(lane.seq)

    def _own(self, seq: int, tag: int, lane: Lane | None) -> None:
        """Lane ``tag`` owns free ``seq`` (``lane`` None: a test's stand-in holding ``held``)."""
        slot = self.slots[seq]
        slot.owner, slot.lane = tag, lane
        self._set_tail(seq, None)   # the lane's KV is its own now (a tail hit's lane carries the tail)
        self._free.pop(bisect.bisect_left(self._free, seq))
        self._free_set.discard(seq)
        self._live.add(seq)

    def _disown(self, seq: int) -> None:
        slot = self.slots[seq]
        slot.owner = slot.lane = None
        bisect.insort(self._free, seq)
        self._free_set.add(seq)
        self._live.discard(seq)

    def _set_held(self, seq: int, tokens: list[int]) -> None:
        """Free ``seq`` now holds ``tokens``."""
        self.slots[seq].held = tokens
        self._set_tail(seq, None)
        if self.index is not None:
            self.index.set(seq, tokens, len(tokens), self.slots[seq].salt)
        if self.slots[seq].owner is None:
            self._note_free(seq)

    def _grew(self, ln: Lane) -> None:
        """``ln``'s KV grew to ``ln.n_past`` tokens: its new whole blocks join the index."""
        if self.index is not None:
            self.index.grow(ln.seq, ln.tokens, ln.n_past)

    def prefill_left(self) -> dict[int, int]:
        """Prompt tokens left per open lane (0 once decoding). A lane missing
        here was not open yet: the daemon keeps its own count for it."""
        return {t: ln.prefill_end - ln.n_past if ln.prefilling else 0 for t, ln in self.lanes.items()}

    def kv_used(self) -> int:
        return sum(ln.n_past for ln in self.lanes.values())

    def _cell(self, ln: Lane) -> int:
        """Deterministic mode: the prompt tokens of ``ln``'s next grid cell."""
        return min((ln.n_past // GRID + 1) * GRID, ln.prefill_end) - ln.n_past

    def _cells_take(self, ln: Lane, cap: int) -> int:
        """Exact mode: the prompt tokens of ``ln``'s next prefill step under ``cap``: whole
        grid cells (at least one) up to, not into, its last step (:func:`last_step`), and
        that step alone once it is next (``cap`` does not split it: it is at most two cells)."""
        end = ln.prefill_end
        last = last_step(end)
        if ln.n_past >= last:
            return end - ln.n_past
        return min(last, max((ln.n_past // GRID + 1) * GRID, (ln.n_past + cap) // GRID * GRID)) - ln.n_past

    def _decode_row(self, ln: Lane) -> BatchRow:
        return BatchRow(seq=ln.seq, tokens=(ln.tokens[ln.n_past],), pos0=ln.n_past, want_logits=ln.pending == 1)

    def _chunk(self, ln: Lane, take: int) -> BatchRow:
        chunk = ln.tokens[ln.n_past : ln.n_past + take]
        return BatchRow(seq=ln.seq, tokens=tuple(chunk), pos0=ln.n_past, want_logits=take == ln.pending)

    def _make_room(self, cells: int) -> None:
        """Shared pool: evict least-recently-used cached sequences until ``cells``
        more fit. Live lanes are never evicted (each lane fits its window, and
        the pool holds max_batch windows)."""
        if not self.shared:
            return
        used = sum(s.size for s in self.slots)
        cached = sorted((s for s in self.slots if s.owner is None and s.held), key=lambda s: s.last_use)
        for slot in cached:
            if used + cells <= self.pool_cells:
                return
            used -= len(slot.held)
            seq = self.slots.index(slot)
            self._spill(seq, keep=0)
            self.engine.seq_rm(seq, 0, -1)
            self._set_held(seq, [])

    # -- one engine step -------------------------------------------------------

    def step(self, *, prefill_budget: int, order: tuple[int, ...] = (), max_step_tokens: int = PREFILL_CHUNK,
             yield_step_tokens: int | None = None, arrived: Callable[[], int] | None = None) -> StepResult:
        """One forward pass, then sample every lane whose pending tokens are all decoded.

        A prefill step takes at most ``max_step_tokens`` prompt tokens, or
        ``yield_step_tokens`` while a lane of a more urgent class than the
        prompt's is decoding (so its next token is not long behind). With
        ``arrived`` (the most urgent priority that arrived since the step was
        planned; lower is more urgent), a prefill-only step is aborted when a
        more urgent job than every lane in it arrives: nothing advances, and
        the result says ``aborted``.

        Shared pool: one token of every decoding lane plus prompt chunks (at
        most ``prefill_budget`` tokens, lanes in ``order`` first) in one batch.

        Per-sequence KV: llama.cpp splits a batch whose sequences carry unequal
        token counts into one micro-batch per token position (8 lanes with a
        1-token decode beside 16-token prompts ran 16 micro-batches: 352 ms
        instead of about 50), so a step is either a decode round (one token of
        every decoding lane) or a prefill step (an equal-length chunk of one or
        more prompts); the two alternate while both have work.
        """
        res = StepResult()
        if self._primed:
            # lanes admitted on a tail hit draw their first token from the kept logits, no pass
            for tag in self._primed:
                ln = self.lanes.get(tag)
                if ln is not None and ln.primed is not None:
                    out, ln.primed = ln.primed, None
                    self._sample_into(res, ln, out)
            self._primed.clear()
            return self._settle(res)
        place = {lane: i for i, lane in enumerate(order)}   # (order.index per lane: O(lanes²) a step)
        prefill_lanes = sorted(
            (ln for ln in self.lanes.values() if ln.prefilling),
            # the most urgent class first (a chat admitted mid-tick goes ahead at once), then the tick's order
            key=lambda ln: (ln.priority, place.get(ln.lane, len(order)), ln.pending),
        )
        decoders = [ln for ln in self.lanes.values() if ln.decoding]
        cap = max_step_tokens
        if yield_step_tokens is not None and prefill_lanes and any(
                d.priority < prefill_lanes[0].priority for d in decoders):
            cap = min(cap, yield_step_tokens)
        budget = min(prefill_budget, cap)
        rows: list[BatchRow] = []
        owners: list[Lane] = []
        if self.shared:
            decode_rows = len(decoders)
            for ln in decoders:
                rows.append(self._decode_row(ln))
                owners.append(ln)
            for ln in prefill_lanes:
                take = self._cell(ln) if self.deterministic else min(ln.pending, budget, PREFILL_CHUNK)
                if budget <= 0 or (take > budget and len(rows) > decode_rows):
                    break
                rows.append(self._chunk(ln, take))
                owners.append(ln)
                budget -= take
        elif prefill_lanes and budget > 0 and (not decoders or self._last_step_decoded):
            decode_rows = 0
            lead = prefill_lanes[0]
            if self.deterministic:
                first = self._cell(lead)
            elif self.exact:
                first = self._cells_take(lead, budget)
            else:
                first = min(lead.pending, budget)
            for ln in prefill_lanes:
                if rows and len(rows) * first + first > budget:
                    break
                if ln.priority != lead.priority:
                    # a less urgent prompt's chunk would only delay the urgent one's first token
                    # (prefill cost grows with the step's tokens): it waits for the next step
                    break
                if self.deterministic:
                    fits = self._cell(ln) == first
                elif self.exact:
                    fits = self._cells_take(ln, first) == first
                else:
                    fits = ln.pending >= first
                if fits:
                    rows.append(self._chunk(ln, first))
                    owners.append(ln)
        else:
            decode_rows = len(decoders)
            if self.gates is not None and decoders:
                return self._draft_round(decoders, res)
            for ln in decoders:
                rows.append(self._decode_row(ln))
                owners.append(ln)
        self._last_step_decoded = decode_rows > 0
        if not rows:
            return res
        self._make_room(sum(len(r.tokens) for r in rows))
        # rows in sequence order: llama.cpp's per-sequence KV runs a batch whose
        # sequences are out of order up to twice as slowly (measured, SmolLM2, 8 lanes)
        order_idx = sorted(range(len(rows)), key=lambda i: rows[i].seq)
        is_decode = [i < decode_rows for i in order_idx]
        rows = [rows[i] for i in order_idx]
        owners = [owners[i] for i in order_idx]
        abort = None
        if arrived is not None and not decode_rows and self.aborts:
            floor = min(ln.priority for ln in owners)
            abort = lambda: arrived() < floor  # noqa: E731
        try:
            outs = self.engine.decode(rows, abort) if abort is not None else self.engine.decode(rows)
        except StepAborted:
            self.stats["aborted"] += 1
            res.aborted = True
            return res
        self.stats["steps"] += 1
        # a lone prompt's last step (any one's in deterministic mode, where rows do not depend on
        # their neighbours) gave the logits a cold lane gets: kept as the lane's tail
        keep = self._keep if self.deterministic or len(rows) == 1 else None
        for row, ln, out, decoding in zip(rows, owners, outs, is_decode, strict=True):
            ln.n_past += len(row.tokens)
            self._grew(ln)
            if decoding:
                res.decode_tokens += 1
            else:
                res.prefill_tokens += len(row.tokens)
            if row.want_logits:
                if keep is not None and not decoding and ln.n_past == ln.n_prompt == len(ln.tokens):
                    ln.tail = keep(out)
                self._sample_into(res, ln, out)
        return self._settle(res)

    def _settle(self, res: StepResult) -> StepResult:
        """After a step's draws: lanes whose sampler failed close unpublished, finished ones publish."""
        for tag, _msg in res.faults:
            self._release(self.lanes.pop(tag), publish=False)
        self.stats["prefill_tokens"] += res.prefill_tokens
        self.stats["decode_tokens"] += res.decode_tokens
        for row in res.emits:
            if row[3] is not None:
                self._release(self.lanes.pop(row[0]), publish=True, finished=True)
        return res

    # -- speculation ------------------------------------------------------------

    def _draft_round(self, decoders: list[Lane], res: StepResult) -> StepResult:
        """A decode round with prompt-lookup drafts (see worker/_spec.py).

        Every row of a drafting round has the same length (one pending token and
        ``depth`` drafts; a lane with a shorter draft or none pads it with its last
        token, and a lane that may not speculate uses only its first position):
        llama.cpp runs a batch whose sequences carry unequal token counts as one
        micro-batch per position."""
        gates = self.gates
        assert gates is not None
        self._last_step_decoded = True
        n = len(decoders)
        depth = gates.depth(n)
        room = min(self.info.n_ctx_seq - 1 - (ln.n_past + 1) for ln in decoders)
        depth = max(PLAIN, min(depth, room))
        drafts: dict[int, list[int]] = {}
        if depth:
            for ln in decoders:
                if ln.spec is not None and gates.wants(ln.spec):
                    got = ln.spec.lookup.draft(ln.tokens, depth)
                    if got:
                        # (a round its drafter has nothing for costs nothing: the yield floor
                        # judges drafting rounds only)
                        drafts[ln.lane] = got
            if not drafts:
                depth = PLAIN
            else:
                depth = max(len(d) for d in drafts.values())
        t0 = gates.clock()
        rows: list[BatchRow] = []
        owners = sorted(decoders, key=lambda x: x.seq)
        for ln in owners:
            if depth:
                draft = drafts.get(ln.lane, [])
                pad = [ln.tokens[-1]] * (depth - len(draft))
                rows.append(BatchRow(seq=ln.seq, tokens=(ln.tokens[ln.n_past], *draft, *pad), pos0=ln.n_past,
                                     want_logits=True, all_logits=True))
            else:
                rows.append(self._decode_row(ln))
        outs = self.engine.decode(rows)
        self.stats["steps"] += 1
        emitted = 0
        for row, ln, out in zip(rows, owners, outs, strict=True):
            if not depth:
                ln.n_past += 1
                self._grew(ln)
                res.decode_tokens += 1
                emitted += self._sample_into(res, ln, out)
                continue
            start = ln.n_past
            drafted = ln.lane in drafts
            verify = drafted or (ln.spec is not None and gates.wants(ln.spec))
            accepted = 0
            for i, handle in enumerate(out):
                got = self._sample_into(res, ln, handle)
                emitted += got
                if not got or res.emits[-1][3] is not None:
                    break   # the lane ended (eos, length, context) or its sampler failed
                if not verify or i == depth or res.emits[-1][1] != row.tokens[i + 1]:
                    break
                accepted += 1
            # KV holds the pending token and the accepted drafts; the rest of the row goes
            valid = start + 1 + accepted
            ln.n_past = valid
            if valid < start + len(row.tokens):
                self.engine.seq_rm(ln.seq, valid, -1)
            self._grew(ln)
            res.decode_tokens += 1 + accepted
            if drafted and ln.spec is not None:
                real = len(drafts[ln.lane])
                ln.spec.rounds += 1
                ln.spec.proposed += real
                ln.spec.accepted += min(accepted, real)
                gates.drafted(real, min(accepted, real))
                gates.judge(ln.spec)
        gates.record(n, depth, emitted, gates.clock() - t0)
        return self._settle(res)

    def _sample_into(self, res: StepResult, ln: Lane, out: Any) -> int:
        """Draw ``ln``'s next token from ``out`` into ``res``; 1 if a row was emitted (a finish
        row of a drafting lane carries its ``[proposed, accepted]``), 0 if its sampler failed."""
        try:
            row = self._sample(ln, out)
        except Exception as exc:  # noqa: BLE001 - boundary: one lane's sampler failed; the batch goes on
            res.faults.append((ln.lane, f"{type(exc).__name__}: {exc}"))
            return 0
        if row[3] is not None and ln.spec is not None and ln.spec.rounds:
            row.append([ln.spec.proposed, ln.spec.accepted])
        res.emits.append(row)
        return 1

    def _capped(self, s: Sampling) -> Sampling:
        """``--spec-max-temperature`` caps a default temperature (the request named none) on a
        speculating worker, so the lane may draft; a temperature the request set is never changed."""
        cap = -1.0 if self.gates is None else self.gates.config.max_temperature
        return attrs.evolve(s, temperature=cap) if s.temperature_default and 0 <= cap < s.temperature else s

    def _lane_sampling(self, msg: Admit) -> Sampling:
        """``ignore_eos`` bans the end-of-generation tokens (a -inf bias, as
        llama-server does), so every generated token is text. Under a grammar
        they stay drawable (a finished grammar allows nothing else) and pass
        through as empty pieces."""
        s = self._capped(msg.sampling)
        if not msg.ignore_eos or s.grammar or not self.info.eog:
            return s
        return attrs.evolve(s, logit_bias=(*s.logit_bias, *((tok, -math.inf) for tok in self.info.eog)))

    def _stop_scan(self, msg: Admit) -> StopScan | None:
        """The lane's stop scan, past what it generated before (a re-admitted lane)."""
        if not msg.stops:
            return None
        scan = StopScan(msg.stops)
        for token in msg.tokens[msg.n_prompt:]:
            scan.feed(b"" if self.engine.is_eog(token) else self.engine.piece(token))
        return scan

    def _sample(self, ln: Lane, out: Any) -> list[Any]:
        k = ln.n_generated
        token = ln.sampler.sample(out, k)
        lp = ln.sampler.logprobs(out, token, ln.sampling.n_logprobs) if ln.sampling.n_logprobs >= 0 else None
        if self.engine.is_eog(token) and not ln.ignore_eos:
            return [ln.lane, token, b"", "eos", lp]
        ln.sampler.accept(token)
        ln.tokens.append(token)
        finish = None
        if ln.n_generated >= ln.max_new:
            finish = "length"
        elif len(ln.tokens) >= self.info.n_ctx_seq:
            finish = "context"
        # an end-of-generation token passed by ignore_eos renders as no text
        piece = b"" if self.engine.is_eog(token) else self.engine.piece(token)
        if ln.stops is not None and ln.stops.feed(piece):
            finish = "stop"   # at the token completing a stop: the engine decodes no further for it
        return [ln.lane, token, piece, finish, lp]

    def close(self) -> None:
        for tag in list(self.lanes):
            self.cancel(tag, publish=False)


def _state_bytes(data: Any) -> Any:
    """An export as bytes for a park or a slot file: llama.cpp's and the mock's already are; an
    export that holds arrays (MLX's) is written out by its ``to_bytes``, here on the engine thread."""
    to_bytes = getattr(data, "to_bytes", None)
    return data if to_bytes is None or isinstance(data, (bytes, bytearray)) else to_bytes()
