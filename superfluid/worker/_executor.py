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

Deterministic mode (``deterministic=True``) computes every KV entry in one
fixed shape, so a lane's logits do not depend on batch composition, step
sizes (measured time), cache state or a restart (on a runtime whose rows do
not depend on the other rows of a batch; see ``LlamaEngine``):

* Prompt tokens are prefilled in grid cells: chunks whose boundaries are the
  multiples of ``GRID`` positions (the prompt's last cell ends at its end);
  a step takes whole cells, never a part sized by its budget.
* Tokens after ``n_prompt`` (a resumed lane's committed tokens) are replayed
  one per decode round, as they were first computed, not prefilled.
* A lane reuses (or copies, or imports) only whole grid cells of an earlier
  prompt; a finished lane's KV is kept only up to its last whole prompt cell
  (a shared pool, which cannot drop a suffix, keeps none).
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Callable
from typing import Any

import attrs

from ..proto import Admit, Sampling
from ._engine import BatchRow, Engine, LaneSampler, StepAborted
from ._hostcache import HOST_MIN_TOKENS, HostCache, common_prefix
from ..proto import SpecConfig
from ._spec import PLAIN, Gates, LaneSpec

__all__ = ["Executor", "Lane", "StepResult"]

PREFILL_CHUNK = 512
MIN_COPY = 4    # a prefix this long elsewhere is copied in (a copy costs about 3 prompt tokens of prefill)
DEMOTE_MIN = 256  # a cached prefix this long moves to a spare sequence rather than be overwritten
# a sequence this short is copied by state export/import (cost grows with its length: 143 tokens
# 3.1 ms on SmolLM2) rather than seq_cp, which copies the whole per-sequence stream (~9 ms at 4,096 cells)
STATE_COPY_MAX = 384
GRID = 64       # deterministic mode: prompt prefill chunk boundaries are the multiples of this position


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
    replay: bool = False   # deterministic: tokens after the prompt are decoded one per round
    spec: LaneSpec | None = None   # drafting state, if this lane may speculate

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
        """The next step for this lane is a one-token decode row."""
        return not self.prefilling and self.pending >= 1


@attrs.define
class StepResult:
    emits: list[list[Any]] = attrs.field(factory=list)
    faults: list[tuple[int, str]] = attrs.field(factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    aborted: bool = False   # the step stopped midway for a more urgent arrival: nothing advanced


@attrs.define(eq=False)
class _Slot:
    tokens: list[int] = attrs.field(factory=list)   # what the sequence's KV holds
    owner: int | None = None                         # lane tag, or None if cached/free
    last_use: int = 0
    salt: str = ""                                   # the cache partition its KV was computed under
    exact: int = 1 << 62                             # deterministic: leading tokens in whole grid cells


def counter_seed(seed: int, k: int) -> int:
    """The RNG seed for generated token ``k`` of a lane seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class Executor:
    def __init__(self, engine: Engine, *, max_lanes: int, host_cache_bytes: int = 0,
                 deterministic: bool = False, speculate: SpecConfig | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.engine = engine
        self.deterministic = deterministic
        self.info = engine.info
        self.max_lanes = max(1, min(max_lanes, engine.info.n_seq))
        self.slots = [_Slot() for _ in range(engine.info.n_seq)]
        self.lanes: dict[int, Lane] = {}
        self.shared = engine.info.kv_layout != "per_seq"
        self.aborts = bool(getattr(engine, "aborts", False))   # the engine can stop a pass midway
        # cells in the KV pool: one buffer per sequence, or one shared pool
        self.pool_cells = int(engine.info.extra.get("n_ctx", 0)) or engine.info.n_seq * engine.info.n_ctx_seq
        self._last_step_decoded = True
        self._clock = 0
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "cached_tokens": 0, "steps": 0, "aborted": 0, "demoted": 0,
                      "state_copies": 0}
        self.host = HostCache(host_cache_bytes)
        self._recent_live: collections.deque[int] = collections.deque(maxlen=2 * self.max_lanes)
        # prompt-lookup speculation (worker/_spec.py); the caller has checked the engine drafts
        if speculate is not None and (deterministic or engine.drafts is not True):
            raise ValueError("prompt-lookup needs a non-deterministic executor over an engine that drafts")
        self.gates = None if speculate is None else Gates(speculate, *([clock] if clock else []))

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
        seq, matched, src = self._pick_slot(tokens, msg.cache_salt)
        slot = self.slots[seq]
        sampler = self.engine.new_sampler(self._lane_sampling(msg), tokens[msg.n_prompt:])
        self._preserve(seq, keep=0 if src is not None else matched, src=src)
        imported = self._import(seq, tokens, msg.cache_salt, better_than=matched)
        if imported is not None:
            matched = imported
        elif src is not None and src != seq:
            self._copy(src, seq, matched)
        elif matched < len(slot.tokens):
            if not self.engine.seq_rm(seq, matched, -1):
                self.engine.seq_rm(seq, 0, -1)
                matched = 0
        slot.tokens = tokens[:matched]
        slot.salt = msg.cache_salt
        slot.owner = msg.lane
        slot.exact = self._cells(msg.n_prompt) if self.deterministic else _Slot.exact
        lane = Lane(
            lane=msg.lane, seq=seq, tokens=tokens, n_prompt=msg.n_prompt, max_new=msg.max_new,
            sampling=msg.sampling, ignore_eos=msg.ignore_eos, sampler=sampler, priority=msg.priority, n_past=matched,
            cached=min(matched, msg.n_prompt), replay=self.deterministic,
            spec=LaneSpec() if self._may_draft(msg.sampling) else None,
        )
        if self.gates is not None:
            self.gates.admitted()
        self.lanes[msg.lane] = lane
        self.stats["cached_tokens"] += lane.cached
        return lane

    def _may_draft(self, s: Sampling) -> bool:
        """Grammar, ``logit_bias`` and logprobs lanes never speculate, nor ones sampling
        hotter than ``--spec-max-temperature``."""
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
            free = [i for i, slot in enumerate(self.slots) if slot.owner is None]
            if not free:
                raise ValueError("no free KV sequence")
            live = [i for i, slot in enumerate(self.slots) if slot.owner is not None]
            self._recent_live.append(len(live))
            matches = [self._reusable(slot, tokens, limit, salt) for slot in self.slots]
            # A wider span costs every decode round (~2 ms per extra sequence at 4 lanes), a
            # copy of a better match once (0.4-10 ms, by its length and the machine's load)
            # the span with i added, from the live span's ends (a span per free sequence over
            # every live one was a quarter of the worker's time admitting at 256 lanes)
            lo, hi = (min(live), max(live)) if live else (None, None)
            spans = {i: 1 if lo is None else max(hi, i) - min(lo, i) + 1 for i in free}
            bound = max(min(spans.values()), 1 + max(self._recent_live))
            allowed = [i for i in free if spans[i] <= bound]
            target = max(allowed, key=lambda i: (matches[i], -spans[i], -i))
            best = max(range(len(self.slots)), key=lambda i: (matches[i], i == target))
            if best != target and matches[best] - matches[target] >= MIN_COPY:
                return target, matches[best], best
            return target, matches[target], None
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

    def _cells(self, n: int) -> int:
        """``n`` rounded down to whole grid cells."""
        return n // GRID * GRID

    def _reusable(self, slot: _Slot, tokens: list[int], limit: int, salt: str) -> int:
        """How many of ``tokens`` (at most ``limit``) ``slot``'s KV can seed: its
        common prefix, under the same salt; in deterministic mode whole cells
        its own prompt filled."""
        if slot.salt != salt:
            return 0
        n = common_prefix(slot.tokens, tokens, limit)
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
            spares = [i for i, other in enumerate(self.slots) if other.owner is None and i not in (seq, src)
                      and (not other.tokens or other.last_use < slot.last_use)]
            if spares:
                spare = min(spares, key=lambda i: (bool(self.slots[i].tokens), self.slots[i].last_use))
                self._spill(spare, keep=0)
                self.engine.seq_rm(spare, 0, -1)
                self.engine.seq_cp(seq, spare, 0, -1)
                self.slots[spare].tokens, self.slots[spare].last_use = list(slot.tokens), slot.last_use
                self.slots[spare].salt = slot.salt
                self.slots[spare].exact = slot.exact
                self.stats["demoted"] += 1
                return
        self._spill(seq, keep=keep)

    def _copy(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold ``src``'s first ``n`` tokens (per-sequence KV)."""
        self.engine.seq_rm(dst, 0, -1)
        held = len(self.slots[src].tokens)
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
        tokens, salt = self.slots[seq].tokens, self.slots[seq].salt
        n = len(tokens)
        if not n:
            return any(i != seq and other.salt == salt for i, other in enumerate(self.slots))
        last = tokens[-1]
        # the length and the last token first: most sequences differ there, at no slice's cost
        return any(i != seq and len(other.tokens) >= n and other.tokens[n - 1] == last and other.salt == salt
                   and common_prefix(other.tokens, tokens, n) == n for i, other in enumerate(self.slots))

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

    def _import(self, seq: int, tokens: list[int], salt: str, *, better_than: int) -> int | None:
        """Seed ``seq`` from the host cache if an entry of ``salt`` covers at least
        ``HOST_MIN_TOKENS`` more of ``tokens`` than ``better_than``. Returns
        the tokens now in ``seq`` (0 if the import failed and left it empty),
        or None if nothing was tried (``seq`` untouched)."""
        found = self.host.best(tokens, len(tokens) - 1, salt, whole=self.shared)
        if found is None or found[1] < better_than + HOST_MIN_TOKENS:
            return None
        key, n = found
        entry = self.host.take(key)
        self.engine.seq_rm(seq, 0, -1)
        self.slots[seq].tokens = []
        self._make_room(len(entry.tokens))
        if not self.engine.seq_import(seq, entry.data):
            self.engine.seq_rm(seq, 0, -1)
            return 0
        if n < len(entry.tokens):
            self.engine.seq_rm(seq, n, -1)
        self.host.stats["hit_tokens"] += n
        return n

    def cancel(self, lane_tag: int, *, publish: bool) -> bool:
        lane = self.lanes.pop(lane_tag, None)
        if lane is None:
            return False
        self._release(lane, publish=publish)
        return True

    def _release(self, lane: Lane, *, publish: bool) -> None:
        lane.sampler.close()
        slot = self.slots[lane.seq]
        slot.owner = None
        self._clock += 1
        slot.last_use = self._clock
        keep = lane.n_past
        if publish and self.deterministic:
            # keep whole prompt cells only: later tokens were computed in another shape
            keep = min(keep, slot.exact)
            if keep < lane.n_past and (self.shared or not self.engine.seq_rm(lane.seq, keep, -1)):
                publish = False  # a shared pool cannot drop a suffix
        if publish:
            slot.tokens = lane.tokens[:keep]
            slot.exact = len(slot.tokens) if self.deterministic else _Slot.exact
        else:
            self.engine.seq_rm(lane.seq, 0, -1)
            slot.tokens = []

    def prefill_left(self) -> dict[int, int]:
        """Prompt tokens left per open lane (0 once decoding). A lane missing
        here was not open yet: the daemon keeps its own count for it."""
        return {t: ln.prefill_end - ln.n_past if ln.prefilling else 0 for t, ln in self.lanes.items()}

    def kv_used(self) -> int:
        return sum(len(s.tokens) for s in self.slots if s.owner is not None)

    def _cell(self, ln: Lane) -> int:
        """Deterministic mode: the prompt tokens of ``ln``'s next grid cell."""
        return min((ln.n_past // GRID + 1) * GRID, ln.prefill_end) - ln.n_past

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
        used = sum(len(s.tokens) for s in self.slots)
        cached = sorted((s for s in self.slots if s.owner is None and s.tokens), key=lambda s: s.last_use)
        for slot in cached:
            if used + cells <= self.pool_cells:
                return
            used -= len(slot.tokens)
            seq = self.slots.index(slot)
            self._spill(seq, keep=0)
            self.engine.seq_rm(seq, 0, -1)
            slot.tokens = []

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
            first = self._cell(prefill_lanes[0]) if self.deterministic else min(
                prefill_lanes[0].pending, budget, PREFILL_CHUNK)
            for ln in prefill_lanes:
                if rows and len(rows) * first + first > budget:
                    break
                if ln.priority != prefill_lanes[0].priority:
                    # a less urgent prompt's chunk would only delay the urgent one's first token
                    # (prefill cost grows with the step's tokens): it waits for the next step
                    break
                if (self._cell(ln) == first) if self.deterministic else ln.pending >= first:
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
        for row, ln, out, decoding in zip(rows, owners, outs, is_decode, strict=True):
            ln.n_past += len(row.tokens)
            self.slots[ln.seq].tokens = ln.tokens[: ln.n_past]
            if decoding:
                res.decode_tokens += 1
            else:
                res.prefill_tokens += len(row.tokens)
            if row.want_logits:
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
                self._release(self.lanes.pop(row[0]), publish=True)
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
                self.slots[ln.seq].tokens = ln.tokens[: ln.n_past]
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
            self.slots[ln.seq].tokens = ln.tokens[:valid]
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

    def _lane_sampling(self, msg: Admit) -> Sampling:
        """``ignore_eos`` bans the end-of-generation tokens (a -inf bias, as
        llama-server does), so every generated token is text. Under a grammar
        they stay drawable (a finished grammar allows nothing else) and pass
        through as empty pieces."""
        s = msg.sampling
        if not msg.ignore_eos or s.grammar or not self.info.eog:
            return s
        return attrs.evolve(s, logit_bias=(*s.logit_bias, *((tok, -math.inf) for tok in self.info.eog)))

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
        return [ln.lane, token, piece, finish, lp]

    def close(self) -> None:
        for tag in list(self.lanes):
            self.cancel(tag, publish=False)
