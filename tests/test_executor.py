"""The generic executor over the deterministic mock engine.

The mock refuses any decode that does not continue its sequence exactly, so
KV bookkeeping mistakes surface as ``RuntimeError`` from ``Executor.step``.
Its next token is a pure function of the context (and of ``(seed, k)`` when
sampling), so a lane's output must not depend on what else runs beside it,
on how its prompt was chunked, or on whether it was stopped and resumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from superfluid.proto import Admit, Sampling
from superfluid.worker import _executor
from superfluid.worker._executor import GRID, PREFILL_CHUNK, Executor, counter_seed, last_step
from superfluid.worker._hostcache import HOST_MIN_TOKENS
from superfluid.worker._mock import N_VOCAB, WORD0, MockEngine
from superfluid.worker._prefix import BLOCK, chain

N_CTX = 800
SPEC = f"mock?step_ms=0&prefill_us=0&n_ctx={N_CTX}&eos_every=24"
MAX_LANES = 3
N_SEQ = MAX_LANES + 2
GREEDY = Sampling(temperature=0.0)
SEEDED = Sampling(temperature=0.8, seed=1234)

Row = tuple[int, str | None]  # (token, finish) of one emitted row


def make(max_lanes: int = MAX_LANES, n_seq: int = N_SEQ, spec: str = SPEC) -> Executor:
    return Executor(MockEngine(spec, n_seq=n_seq), max_lanes=max_lanes)


def words(*ids: int) -> list[int]:
    return [WORD0 + i for i in ids]


def make_admit(lane: int, prompt: list[int], generated: Sequence[int] = (), *, max_new: int = 16,
               sampling: Sampling = GREEDY) -> Admit:
    return Admit(lane=lane, tokens=[*prompt, *generated], n_prompt=len(prompt), max_new=max_new, sampling=sampling)


def drain(ex: Executor, *, budget: int = PREFILL_CHUNK, max_steps: int = 10_000) -> dict[int, list[Row]]:
    """Step until every lane has finished; the rows each lane emitted."""
    out: dict[int, list[Row]] = {tag: [] for tag in ex.lanes}
    for _ in range(max_steps):
        if not ex.lanes:
            return out
        res = ex.step(prefill_budget=budget)
        assert not res.faults
        for lane, token, _piece, finish, _lp in res.emits:
            out.setdefault(lane, []).append((token, finish))
    raise AssertionError(f"lanes {sorted(ex.lanes)} did not finish in {max_steps} steps")


_REFERENCE: dict[tuple[Any, ...], list[Row]] = {}


def reference(prompt: list[int], *, max_new: int, sampling: Sampling) -> list[Row]:
    """The rows a lane emits when it runs alone, start to finish."""
    key = (tuple(prompt), max_new, sampling)
    if key not in _REFERENCE:
        ex = make(max_lanes=1, n_seq=1)
        ex.admit(make_admit(0, prompt, max_new=max_new, sampling=sampling))
        _REFERENCE[key] = drain(ex)[0]
    return _REFERENCE[key]


def generated_tokens(rows: list[Row]) -> list[int]:
    """The tokens a lane appended (an ``eos`` row's token is not part of its text)."""
    return [tok for tok, finish in rows if finish != "eos"]


def check_invariants(ex: Executor) -> None:
    engine: MockEngine = ex.engine  # type: ignore[assignment]
    assert len(ex.lanes) <= ex.max_lanes
    owners = [slot.owner for slot in ex.slots if slot.owner is not None]
    assert sorted(owners) == sorted(ex.lanes), "a slot is owned by a lane that is gone, or by two lanes"
    assert len({ln.seq for ln in ex.lanes.values()}) == len(ex.lanes)
    for tag, ln in ex.lanes.items():
        slot = ex.slots[ln.seq]
        assert slot.owner == tag
        assert slot.tokens == ln.tokens[: ln.n_past]
        assert 1 <= ln.pending
        assert len(ln.tokens) < ex.info.n_ctx_seq
    for i, slot in enumerate(ex.slots):
        assert engine.kv[i] == slot.tokens, f"seq {i}: the engine's KV and the executor's record differ"
    check_index(ex)
    assert ex.kv_used() == sum(ln.n_past for ln in ex.lanes.values())
    assert ex.prefill_left() == {t: ln.pending if ln.pending > 1 else 0 for t, ln in ex.lanes.items()}


def check_index(ex: Executor) -> None:
    """The admission's bookkeeping says what the slots say: free and live sequences, and
    each sequence's block chain in the prefix index (and nothing else in it)."""
    assert ex._free == [i for i, slot in enumerate(ex.slots) if slot.owner is None]
    assert ex._free_set == set(ex._free) and ex._live == {i for i, s in enumerate(ex.slots) if s.owner is not None}
    if ex.index is None:
        return
    members: dict[int, set[int]] = {}
    for i, slot in enumerate(ex.slots):
        want = chain(slot.tokens, slot.size // BLOCK, slot.salt)
        assert ex.index.chain_of(i) == want, f"seq {i}: its index chain is stale"
        assert i in ex.index.salted(slot.salt)
        for h in want:
            members.setdefault(h, set()).add(i)
    assert {h: ex.index.members(h) for h in members} == members
    assert ex.index.sizes() == (len(members), sum(map(len, members.values()))), "the index holds stale nodes"


# ---- deterministic properties -------------------------------------------------------------

PROMPTS = [
    words(0, 2, 38, 18, 0, 6, 43),
    words(*range(40)) * 3,        # 120 tokens
    words(*range(50)) * 13,       # 650 tokens: more than one prefill chunk
    [1, *words(7, 7, 7)],
]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("budget", [1, 7, 64, PREFILL_CHUNK])
def test_output_does_not_depend_on_chunking(sampling: Sampling, budget: int) -> None:
    for prompt in PROMPTS:
        ex = make()
        ex.admit(make_admit(0, prompt, max_new=30, sampling=sampling))
        assert drain(ex, budget=budget)[0] == reference(prompt, max_new=30, sampling=sampling)
        check_invariants(ex)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_output_is_identical_alone_and_batched(sampling: Sampling) -> None:
    ex = make(max_lanes=len(PROMPTS), n_seq=len(PROMPTS) + 1)
    rows: dict[int, list[Row]] = {}
    # staggered admission: each lane joins a batch that is already mid-flight
    for tag, prompt in enumerate(PROMPTS):
        ex.admit(make_admit(tag, prompt, max_new=30, sampling=sampling))
        for _ in range(3):
            res = ex.step(prefill_budget=100)
            for lane, token, _piece, finish, _lp in res.emits:
                rows.setdefault(lane, []).append((token, finish))
            check_invariants(ex)
    for lane, more in drain(ex, budget=100).items():
        rows.setdefault(lane, []).extend(more)
    for tag, prompt in enumerate(PROMPTS):
        assert rows[tag] == reference(prompt, max_new=30, sampling=sampling)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_resumed_lane_continues_identically(sampling: Sampling) -> None:
    prompt = PROMPTS[1]
    full = reference(prompt, max_new=30, sampling=sampling)
    gen = generated_tokens(full)
    assert len(gen) >= 5
    for k in range(len(gen)):
        ex = make()
        lane = ex.admit(make_admit(0, prompt, gen[:k], max_new=30, sampling=sampling))
        assert lane.n_generated == k
        assert drain(ex)[0] == full[k:], f"resumed after {k} tokens"


def test_seeded_sampling_is_not_greedy() -> None:
    # otherwise the seeded tests above would prove nothing about the counter
    prompt = PROMPTS[1]
    assert reference(prompt, max_new=30, sampling=SEEDED) != reference(prompt, max_new=30, sampling=GREEDY)
    other = attrs.evolve(SEEDED, seed=SEEDED.seed + 1)
    assert reference(prompt, max_new=30, sampling=SEEDED) != reference(prompt, max_new=30, sampling=other)
    assert counter_seed(1234, 3) == counter_seed(1234, 3) != counter_seed(1234, 4)


def test_preempted_lane_resumes_from_its_published_kv() -> None:
    prompt = PROMPTS[1]
    full = reference(prompt, max_new=30, sampling=SEEDED)
    ex = make()
    ex.admit(make_admit(0, prompt, max_new=30, sampling=SEEDED))
    rows: list[Row] = []
    while len(rows) < 10:
        rows += [(r[1], r[3]) for r in ex.step(prefill_budget=PREFILL_CHUNK).emits]
    assert ex.cancel(0, publish=True)
    check_invariants(ex)
    gen = generated_tokens(rows)
    lane = ex.admit(make_admit(1, prompt, gen, max_new=30, sampling=SEEDED))
    # everything decoded before the preemption is reused; only the last token is pending
    assert lane.cached == len(prompt)
    assert lane.pending == 1
    assert rows + drain(ex)[1] == full


def test_prefix_cache_reports_cached_tokens_on_a_repeat() -> None:
    prompt = PROMPTS[1]
    ex = make()
    first = ex.admit(make_admit(0, prompt))
    assert first.cached == 0
    drain(ex)
    again = ex.admit(make_admit(1, prompt))
    # all but the last prompt token (which must be decoded again for logits)
    assert again.cached == len(prompt) - 1
    assert ex.stats["cached_tokens"] == len(prompt) - 1
    assert drain(ex)[1] == reference(prompt, max_new=16, sampling=GREEDY)
    check_invariants(ex)


def test_prefix_cache_shares_a_prefix_with_a_running_lane() -> None:
    prompt = PROMPTS[1]
    longer = prompt + words(1, 2, 3)
    ex = make()
    ex.admit(make_admit(0, prompt, max_new=30))
    ex.step(prefill_budget=PREFILL_CHUNK)
    # lane 0 is running; lane 1's prompt extends it, so its KV is copied from lane 0's
    lane = ex.admit(make_admit(1, longer, max_new=30))
    assert lane.cached == len(prompt)
    check_invariants(ex)
    out = drain(ex)
    assert out[1] == reference(longer, max_new=30, sampling=GREEDY)
    check_invariants(ex)


def test_cancel_without_publish_drops_the_kv() -> None:
    prompt = PROMPTS[1]
    ex = make()
    ex.admit(make_admit(0, prompt))
    ex.step(prefill_budget=PREFILL_CHUNK)
    assert ex.cancel(0, publish=False)
    assert not ex.cancel(0, publish=False)
    check_invariants(ex)
    assert ex.admit(make_admit(1, prompt)).cached == 0


def test_admit_refuses_what_does_not_fit() -> None:
    ex = make(max_lanes=1)
    with pytest.raises(ValueError):
        ex.admit(make_admit(0, words(1) * N_CTX))
    with pytest.raises(ValueError):
        ex.admit(make_admit(0, words(1), sampling=Sampling(grammar="root ::= x")))
    ex.admit(make_admit(0, words(1)))
    with pytest.raises(ValueError):
        ex.admit(make_admit(1, words(1)))
    check_invariants(ex)


def test_context_window_ends_a_lane() -> None:
    ex = make(spec="mock?step_ms=0&prefill_us=0&n_ctx=40&eos_every=1000000")
    ex.admit(make_admit(0, words(*range(30)), max_new=100))
    rows = drain(ex)[0]
    assert rows[-1][1] == "context"
    assert len(generated_tokens(rows)) == 40 - 30


def test_length_ends_a_lane_counting_resumed_tokens() -> None:
    spec = "mock?step_ms=0&prefill_us=0&eos_every=1000000"
    ex = make(spec=spec)
    ex.admit(make_admit(0, words(1, 2, 3), max_new=5))
    full = drain(ex)[0]
    assert len(full) == 5 and full[-1][1] == "length"
    ex.admit(make_admit(1, words(1, 2, 3), generated_tokens(full)[:3], max_new=5))
    assert drain(ex)[1] == full[3:]


# ---- random interleavings ---------------------------------------------------------------

token_ids = st.integers(WORD0, N_VOCAB - 1) | st.integers(5 + ord("a"), 5 + ord("z"))
prompts = st.one_of(
    st.lists(token_ids, min_size=1, max_size=40),
    st.builds(lambda base, tail: base + tail, st.sampled_from(PROMPTS), st.lists(token_ids, max_size=8)),
    st.sampled_from(PROMPTS),
)
samplings = st.sampled_from([GREEDY, SEEDED]) | st.builds(
    lambda s: Sampling(temperature=1.0, seed=s), st.integers(0, 2**32 - 1)
)


@attrs.define
class Track:
    prompt: list[int]
    max_new: int
    sampling: Sampling
    rows: list[Row] = attrs.field(factory=list)  # emitted so far, across resumes

    @property
    def expected(self) -> list[Row]:
        return reference(self.prompt, max_new=self.max_new, sampling=self.sampling)


class ExecutorMachine(RuleBasedStateMachine):
    """Admit, step, cancel and resume at random; every lane's output must match
    its solo run, and the KV bookkeeping must stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.ex = make()
        self.tracks: dict[int, Track] = {}       # live lanes
        self.preempted: list[Track] = []        # stopped with publish=True, to resume
        self.next_tag = 0

    def _open(self, track: Track) -> None:
        tag = self.next_tag
        self.next_tag += 1
        msg = make_admit(tag, track.prompt, generated_tokens(track.rows), max_new=track.max_new,
                         sampling=track.sampling)
        tokens = list(msg.tokens)
        for recent in (0, len(self.ex._live), 2 * MAX_LANES):
            # the prefix index chooses what asking every sequence chooses
            assert self.ex._pick_indexed(tokens, len(tokens) - 1, "", recent) == self.ex._pick_scan(
                tokens, len(tokens) - 1, "", recent)
        lane = self.ex.admit(msg)
        assert lane.cached <= len(track.prompt)
        self.tracks[tag] = track

    @precondition(lambda self: len(self.ex.lanes) < MAX_LANES)
    @rule(prompt=prompts, max_new=st.integers(1, 24), sampling=samplings)
    def admit(self, prompt: list[int], max_new: int, sampling: Sampling) -> None:
        self._open(Track(prompt=prompt, max_new=max_new, sampling=sampling))

    @precondition(lambda self: len(self.ex.lanes) < MAX_LANES and self.preempted)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        track = data.draw(st.sampled_from(self.preempted))
        self.preempted.remove(track)
        self._open(track)

    @precondition(lambda self: self.ex.lanes)
    @rule(data=st.data(), budget=st.sampled_from([0, 1, 5, 64, 300, PREFILL_CHUNK, 4096]))
    def step(self, data: st.DataObject, budget: int) -> None:
        order = tuple(data.draw(st.permutations(sorted(self.ex.lanes))))
        res = self.ex.step(prefill_budget=budget, order=order)
        assert not res.faults
        assert res.prefill_tokens <= budget
        for lane, token, _piece, finish, _lp in res.emits:
            track = self.tracks[lane]
            track.rows.append((token, finish))
            assert track.rows == track.expected[: len(track.rows)]
            if finish is not None:
                assert lane not in self.ex.lanes
                assert track.rows == track.expected
                del self.tracks[lane]
        assert set(self.tracks) == set(self.ex.lanes)

    @precondition(lambda self: self.ex.lanes)
    @rule(data=st.data(), publish=st.booleans(), resume=st.booleans())
    def cancel(self, data: st.DataObject, publish: bool, resume: bool) -> None:
        tag = data.draw(st.sampled_from(sorted(self.ex.lanes)))
        assert self.ex.cancel(tag, publish=publish)
        track = self.tracks.pop(tag)
        if resume:
            self.preempted.append(track)

    @invariant()
    def bookkeeping(self) -> None:
        check_invariants(self.ex)

    def teardown(self) -> None:
        # every lane finishes, with exactly its solo output
        for track in self.preempted:
            if len(self.ex.lanes) >= MAX_LANES:
                break
            self._open(track)
        for lane, rows in drain(self.ex).items():
            track = self.tracks.pop(lane)
            assert track.rows + rows == track.expected
        assert not self.tracks
        check_invariants(self.ex)


ExecutorMachine.TestCase.settings = settings(
    database=None, deadline=None, max_examples=60, stateful_step_count=30
)
TestExecutorMachine = ExecutorMachine.TestCase


# -- the host cache -------------------------------------------------------------------


def test_an_evicted_prefix_comes_back_from_host_memory() -> None:
    """With no spare sequence, a long cached prefix is exported before it is
    overwritten and imported when a prompt needs it again."""
    ex = Executor(MockEngine(SPEC, n_seq=1), max_lanes=1, host_cache_bytes=1 << 20)
    long_prompt = words(*range(50)) * 6         # 300 tokens
    ex.admit(make_admit(0, long_prompt, max_new=4))
    first = generated_tokens(drain(ex)[0])
    ex.admit(make_admit(1, words(*range(3, 50)), max_new=2))   # takes the only sequence
    drain(ex)
    assert len(ex.host) == 1 and ex.slots[0].tokens[:10] != long_prompt[:10]
    again = ex.admit(make_admit(3, [*long_prompt, WORD0 + 7], max_new=4))
    assert again.cached == again.n_past == 300 and ex.host.stats["hits"] == 1
    assert len(ex.host) == 1 and ex.host.best(long_prompt, 300, whole=False) is None   # holds the short one now
    check_invariants(ex)
    rows = drain(ex)[3]
    assert generated_tokens(rows) == generated_tokens(reference([*long_prompt, WORD0 + 7], max_new=4,
                                                                sampling=GREEDY))
    # a replay of the first prompt alone gives what it gave the first time
    ex.admit(make_admit(4, long_prompt, max_new=4))
    assert generated_tokens(drain(ex)[4]) == first


def test_a_cached_prefix_moves_aside_instead_of_being_overwritten() -> None:
    """With no empty sequence left, compact placement reuses the low sequences; what
    they cached moves to a spare sequence (the least recently used), and comes back by copy."""
    ex = Executor(MockEngine(SPEC, n_seq=2), max_lanes=1)
    a, b, c = words(*range(50)) * 6, words(*range(5, 50)) * 6, words(*range(9, 50)) * 6
    for tag, prompt in enumerate((a, b, a)):   # b takes the empty sequence; a again, its own
        ex.admit(make_admit(tag, prompt, max_new=3))
        drain(ex)
    assert ex.stats["demoted"] == 0 and ex.slots[0].tokens[:300] == a and ex.slots[1].tokens[:270] == b
    ex.admit(make_admit(3, c, max_new=3))   # lands on a's sequence (the lowest); a moves over b
    drain(ex)
    assert ex.stats["demoted"] == 1 and ex.slots[1].tokens[:300] == a
    back = ex.admit(make_admit(4, a, max_new=3))
    assert back.cached == len(a) - 1
    check_invariants(ex)
    assert generated_tokens(drain(ex)[4]) == generated_tokens(reference(a, max_new=3, sampling=GREEDY))


def test_lone_requests_keep_their_own_sequences_while_empty_ones_remain() -> None:
    """A lone request whose best match would overwrite another prompt's cached tokens
    takes an empty sequence instead, the shared prefix copied in; so lone requests on
    several prompts, sent again, are each answered from cache (one sequence rewritten by
    each kept only the last); the lowest empty one first, however recently a lane left it,
    so the prompts sit packed for the wave that comes back to them. An empty sequence that
    would widen the live span stays unused."""
    ex = Executor(MockEngine(SPEC, n_seq=8), max_lanes=4)
    for seq in (1, 2, 3):   # used by an earlier wave that left them empty: the lowest empty still goes first
        ex.slots[seq].last_use = ex._clock = ex._clock + 1
        ex._note_free(seq)
    system = words(*range(40))
    prompts = [[*system, *words(41 + 3 * k, 42 + 3 * k, 43 + 3 * k)] for k in range(4)]
    for tag, prompt in enumerate(prompts):
        got = ex.admit(make_admit(tag, prompt, max_new=3))
        assert got.cached == (0 if tag == 0 else len(system))   # the shared prefix, copied in
        drain(ex)
    assert sorted(ex.slots.index(s) for s in ex.slots if s.tokens) == [0, 1, 2, 3]
    for tag, prompt in enumerate(prompts, start=10):
        assert ex.admit(make_admit(tag, prompt, max_new=3)).cached == len(prompt) - 1
        drain(ex)
    check_invariants(ex)
    # a live lane on sequence 0 (continuing the prompt it holds): the next lane stays beside
    # it, over another prompt's tokens, rather than take empty sequence 4 and widen the span
    ex.admit(make_admit(20, [*ex.slots[0].tokens, *words(*range(20, 30)) * 6], max_new=500))
    ex.step(prefill_budget=PREFILL_CHUNK)
    assert {i for i, s in enumerate(ex.slots) if s.owner is not None} == {0}
    lane = ex.admit(make_admit(21, [*system, *words(2, 3, 4)], max_new=3))
    assert (lane.seq, lane.cached) == (1, len(system))
    drain(ex)
    check_invariants(ex)


def test_short_prefixes_and_a_zero_budget_stay_out_of_host_memory() -> None:
    for budget, prompt in ((1 << 20, words(*range(HOST_MIN_TOKENS - 3))), (0, words(*range(50)) * 6)):
        ex = Executor(MockEngine(SPEC, n_seq=1), max_lanes=1, host_cache_bytes=budget)
        ex.admit(make_admit(0, prompt, max_new=2))
        drain(ex)
        ex.admit(make_admit(1, words(*range(9, 30)), max_new=2))
        drain(ex)
        assert len(ex.host) == 0


@pytest.mark.parametrize("lost", [HOST_MIN_TOKENS - 1, HOST_MIN_TOKENS])
def test_a_prefix_goes_to_host_memory_only_when_it_would_lose_enough(lost: int) -> None:
    """A cached sequence is exported only when the new lane would overwrite at least
    ``HOST_MIN_TOKENS`` of it: a long prefix that the new prompt mostly keeps stays put."""
    ex = Executor(MockEngine(SPEC, n_seq=1), max_lanes=1, host_cache_bytes=1 << 20)
    ex.admit(make_admit(0, words(*range(40)), max_new=2))
    drain(ex)
    held = list(ex.slots[0].tokens)
    assert len(held) > 2 * HOST_MIN_TOKENS
    ex.admit(make_admit(1, [*held[: len(held) - lost], *words(45, 46, 47)], max_new=2))  # the only sequence
    drain(ex)
    assert len(ex.host) == (lost >= HOST_MIN_TOKENS)


def test_a_short_overwritten_prompt_comes_back_from_host_memory() -> None:
    """Compact placement overwrites short cached prompts too; they are exported
    first (cheap next to a prefill) and imported when asked for again."""
    ex = Executor(MockEngine(SPEC, n_seq=1), max_lanes=1, host_cache_bytes=1 << 20)
    short = words(*range(12))
    ex.admit(make_admit(0, short, max_new=3))
    first = generated_tokens(drain(ex)[0])
    ex.admit(make_admit(1, words(*range(20, 40)), max_new=2))   # takes the only sequence
    drain(ex)
    assert len(ex.host) == 1
    again = ex.admit(make_admit(2, short, max_new=3))
    assert again.cached == len(short) - 1 and ex.host.stats["hits"] == 1
    check_invariants(ex)
    assert generated_tokens(drain(ex)[2]) == first


def test_a_short_prefix_is_copied_by_state_and_a_long_one_by_seq_cp() -> None:
    """A better match on another sequence comes over by state export/import
    when that sequence is short (a whole-stream seq_cp costs more), by seq_cp
    when it is long; either way the lane continues as a fresh prefill would."""
    for prompt, by_state in ((words(*range(40)), True), (words(*range(50)) * 9, False)):
        ex = Executor(MockEngine(SPEC, n_seq=4), max_lanes=2)
        ex.admit(make_admit(0, words(*range(30, 45)), max_new=40))   # lives on sequence 0 throughout
        ex.step(prefill_budget=4096)
        ex._set_held(3, prompt[:-1])                                 # a cached copy, out of the span
        ex.engine.kv[3] = prompt[:-1]
        lane = ex.admit(make_admit(1, prompt, max_new=3))
        assert lane.seq == 1 and lane.cached == len(prompt) - 1
        assert ex.stats["state_copies"] == int(by_state)
        check_invariants(ex)
        assert generated_tokens(drain(ex)[1]) == generated_tokens(reference(prompt, max_new=3, sampling=GREEDY))


def test_common_prefix_matches_a_plain_scan() -> None:
    import random

    from superfluid.worker._hostcache import common_prefix

    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(0, 400)
        a = [rng.randrange(3) for _ in range(n)]
        b = a[: rng.randrange(0, n + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 50))]
        limit = rng.randrange(0, 450)
        plain = 0
        while plain < min(len(a), len(b), limit) and a[plain] == b[plain]:
            plain += 1
        assert common_prefix(a, b, limit) == plain


def test_the_host_cache_keeps_its_byte_budget() -> None:
    from superfluid.worker._hostcache import HostCache

    cache = HostCache(1000)
    cache.put(list(range(300)), b"a" * 400)
    cache.put(list(range(1000, 1300)), b"b" * 400)
    cache.put(list(range(2000, 2300)), b"c" * 400)        # evicts the oldest
    assert cache.bytes == 800 and cache.best(list(range(300)), 299, whole=False) is None
    cache.put(list(range(1000, 1400)), b"d" * 500)        # covers (replaces) the second entry
    assert cache.bytes == 900 and len(cache) == 2
    assert not cache.wants(list(range(1000, 1300)))      # already covered
    key, n = cache.best([*range(1000, 1350), 7], 500, whole=False)
    assert n == 350 and cache.best([*range(1000, 1350), 7], 500, whole=True) is None
    assert cache.take(key).data == b"d" * 500 and cache.bytes == 400


def test_a_new_lane_keeps_the_live_sequences_compact() -> None:
    """llama.cpp's per-sequence KV slows with the span of sequence ids in a
    batch: a new lane fills a hole between live lanes, and a better prefix
    cached further out is copied in rather than widening the span."""
    ex = Executor(MockEngine(SPEC, n_seq=8), max_lanes=4)
    prompt = words(*range(30))
    for seq, owner in ((0, 100), (3, 101)):
        ex._own(seq, owner, None)
    ex._set_held(5, prompt[:20])              # a cached prefix outside the live lanes
    ex._set_held(2, prompt[:2])
    assert ex._pick_slot(prompt) == (2, 20, 5)
    ex._disown(0)
    ex._disown(3)
    assert ex._pick_slot(prompt) == (5, 20, None)  # nothing live: the best match, in place


def test_a_wave_on_known_prompts_goes_back_to_their_sequences() -> None:
    """Eight lanes end together and eight requests on the same prompts come
    back in another order (a client's next wave): the span may grow to the
    eight lanes the last wave had, so each lane takes the sequence already
    holding its prompt: no copy, no host import, no prefill beyond the last
    prompt token."""
    ex = Executor(MockEngine(SPEC, n_seq=10), max_lanes=8, host_cache_bytes=1 << 30)
    prompts = [words(i, *range(20, 40)) for i in range(8)]
    for order in (range(8), (5, 0, 7, 2, 4, 1, 6, 3), (3, 6, 1, 4, 2, 7, 0, 5)):
        home = {i: next(s for s, slot in enumerate(ex.slots) if slot.tokens[: len(p) - 1] == p[:-1])
                for i, p in enumerate(prompts) if any(slot.tokens[: len(p) - 1] == p[:-1] for slot in ex.slots)}
        copies, hits = ex.stats["state_copies"], ex.host.stats["hits"]
        lanes = {i: ex.admit(make_admit(i, prompts[i], max_new=12)) for i in order}
        check_invariants(ex)
        for i, lane in lanes.items():
            if i in home:
                assert (lane.seq, lane.cached) == (home[i], len(prompts[i]) - 1)
        if home:
            assert (ex.stats["state_copies"], ex.host.stats["hits"]) == (copies, hits)
        drain(ex)
    assert ex._pick_slot(prompts[0])[0] in range(10)


def test_lanes_pack_tightly_again_when_the_load_drops() -> None:
    """The span allowance follows the recent load: right after a wave of four,
    a pair of lanes may spread as far as the wave did (the second takes its
    prompt in place, three sequences away); after more than ``2 * max_lanes``
    lone requests a pair packs side by side again (the prompt is copied in)."""
    ex = Executor(MockEngine(SPEC, n_seq=4), max_lanes=4)   # no sequence stays empty: the span rule alone places
    wave = [words(40 + i, *range(10, 30)) for i in range(4)]
    for i, p in enumerate(wave):
        ex.admit(make_admit(i, p, max_new=4))
    drain(ex)
    home = next(s for s, slot in enumerate(ex.slots) if slot.tokens[:20] == wave[3][:20])
    first = ex.admit(make_admit(10, words(30, 1, 2), max_new=2))
    second = ex.admit(make_admit(11, wave[3], max_new=2))
    assert abs(first.seq - home) == 3 and (second.seq, second.cached) == (home, len(wave[3]) - 1)
    drain(ex)
    for i in range(9):
        ex.admit(make_admit(20 + i, words(i, 1, 2), max_new=2))
        drain(ex)
    copies = ex.stats["state_copies"]
    first = ex.admit(make_admit(30, words(30, 1, 2), max_new=2))
    second = ex.admit(make_admit(31, wave[3], max_new=2))
    assert abs(first.seq - second.seq) == 1 and second.cached == len(wave[3]) - 1
    assert ex.stats["state_copies"] == copies + 1
    check_invariants(ex)


# ---- long prompts beside more urgent lanes -------------------------------------------------

URGENT, AGENT = 0, 2   # Admit.priority: interactive, agent


def test_a_prefill_step_is_aborted_only_for_a_more_urgent_arrival() -> None:
    """Executor.step's ``arrived``: a prompt pass of agent lanes stops for a chat
    (nothing advances, and the lane later finishes exactly as it would have), but
    not for another agent. Without the abort, a chat waits out the whole pass."""
    prompt = PROMPTS[2]    # 650 tokens: two passes
    ex = make(spec="mock?step_ms=0&prefill_us=50&n_ctx=800&eos_every=24")
    engine: MockEngine = ex.engine  # type: ignore[assignment]
    ex.admit(attrs.evolve(make_admit(0, prompt), priority=AGENT))
    res = ex.step(prefill_budget=PREFILL_CHUNK, arrived=lambda: AGENT)
    assert not res.aborted and res.prefill_tokens == PREFILL_CHUNK
    res = ex.step(prefill_budget=PREFILL_CHUNK, arrived=lambda: URGENT)
    assert res.aborted and res.prefill_tokens == 0 and ex.stats["aborted"] == 1
    assert ex.lanes[0].n_past == PREFILL_CHUNK == len(engine.kv[ex.lanes[0].seq])
    check_invariants(ex)
    assert drain(ex)[0] == reference(prompt, max_new=16, sampling=GREEDY)


def test_a_decode_round_is_never_aborted() -> None:
    ex = make(spec="mock?step_ms=5&prefill_us=0&n_ctx=800&eos_every=1000000")
    ex.admit(attrs.evolve(make_admit(0, PROMPTS[0], max_new=4), priority=AGENT))
    ex.step(prefill_budget=PREFILL_CHUNK)
    res = ex.step(prefill_budget=PREFILL_CHUNK, arrived=lambda: URGENT)
    assert not res.aborted and res.decode_tokens == 1


@pytest.mark.parametrize(("decoding", "expected"), [(None, 512), (AGENT, 512), (URGENT, 64)],
                         ids=["alone", "beside-an-agent", "beside-a-chat"])
def test_prefill_steps_shrink_only_while_a_more_urgent_lane_decodes(decoding: int | None, expected: int) -> None:
    ex = make()
    if decoding is not None:
        ex.admit(attrs.evolve(make_admit(1, PROMPTS[0], max_new=100), priority=decoding))
        ex.step(prefill_budget=PREFILL_CHUNK)   # its prompt: it decodes from here on
        assert ex.lanes[1].decoding
    ex.admit(attrs.evolve(make_admit(0, PROMPTS[2]), priority=AGENT))
    steps = [ex.step(prefill_budget=4096, max_step_tokens=512, yield_step_tokens=64) for _ in range(2)]
    assert max(s.prefill_tokens for s in steps) == expected


def test_an_aborting_engines_prefill_step_takes_its_whole_batch() -> None:
    """On an engine that can abort a pass, a prefill step takes the engine's batch (llama.cpp's
    n_batch, which it runs as 512-token micro-batches), not one micro-batch: a long prompt is cut
    by a decode round every 2,048 tokens, as in llama-server, not every 512 (issue #18); an urgent
    arrival still stops the step."""
    engine = MockEngine(SPEC, n_seq=N_SEQ)
    engine.info.extra["n_batch"] = 2048
    ex = Executor(engine, max_lanes=MAX_LANES)
    assert ex.aborts and ex.abortable_step == 2048 and make().abortable_step == PREFILL_CHUNK
    ex.admit(make_admit(0, PROMPTS[2]))                       # 650 prompt tokens: one step
    assert ex.step(prefill_budget=4096, max_step_tokens=ex.abortable_step).prefill_tokens == 650
    check_invariants(ex)


def test_a_chats_prompt_step_carries_no_agents_chunks() -> None:
    """A prefill step holds prompts of one class, the most urgent waiting: a chat's short
    prompt is not padded out with agents' equal-length chunks (each costs prefill time before
    the chat's first token); agents of one class still share their steps."""
    ex = make(max_lanes=4, n_seq=6)
    for lane in (1, 2):
        ex.admit(attrs.evolve(make_admit(lane, PROMPTS[2]), priority=AGENT))
    ex.step(prefill_budget=PREFILL_CHUNK)
    before = {t: ex.lanes[t].n_past for t in (1, 2)}
    chat = words(1, 2, 3, 4, 5)
    ex.admit(attrs.evolve(make_admit(0, chat), priority=URGENT))
    res = ex.step(prefill_budget=PREFILL_CHUNK)
    assert res.prefill_tokens == len(chat) and [e[0] for e in res.emits] == [0]
    assert {t: ex.lanes[t].n_past for t in (1, 2)} == before
    check_invariants(ex)


# ---- exact mode: the prompt's last prefill step (issue 51) ------------------------------------


class _StepRecorder(MockEngine):
    """A mock that says, as llama.cpp with one KV stream per sequence does, that a row's result
    depends on its pass's shape (``grid``: the executor runs in exact mode), and records each
    pass as its rows' (seq, pos0, n_tokens)."""

    grid = True

    def __init__(self, spec: str, *, n_seq: int) -> None:
        super().__init__(spec, n_seq=n_seq)
        self.steps: list[list[tuple[int, int, int]]] = []

    def decode(self, rows: list[Any], abort: Any = None) -> list[Any]:
        self.steps.append([(r.seq, r.pos0, len(r.tokens)) for r in rows])
        return super().decode(rows, abort)


def _grid_ex(n_seq: int = 2, host: int = 0) -> tuple[Executor, _StepRecorder]:
    engine = _StepRecorder("mock?step_ms=0&prefill_us=0&n_ctx=4096&eos_every=1000000", n_seq=n_seq)
    ex = Executor(engine, max_lanes=1, host_cache_bytes=host)
    assert ex.exact and not ex.deterministic
    return ex, engine


def _last_prompt_step(eng: _StepRecorder, seq: int, end: int) -> list[tuple[int, int, int]] | None:
    """The pass that computed ``seq``'s last prompt token (its logits gave the first draw), or
    None if no pass did (a tail hit: the kept logits gave it)."""
    return next((step for step in reversed(eng.steps) if any(s == seq and p + n == end for s, p, n in step)), None)


def _drop_tails(ex: Executor) -> None:
    """Forget every kept last-step logits (as ``TAIL_BYTES`` drops the oldest)."""
    for seq in list(ex._tails):
        ex._set_tail(seq, None)


def _serve(ex: Executor, eng: _StepRecorder, prompt: list[int], lane: int, budget: int = 2048
           ) -> tuple[int, list[tuple[int, int, int]], list[Row]]:
    """One lane alone: (tokens it reused, the pass of its last prompt token, its rows)."""
    eng.steps.clear()
    ln = ex.admit(make_admit(lane, prompt, max_new=3))
    rows = drain(ex, budget=budget)[lane]
    return ln.cached, _last_prompt_step(eng, ln.seq, len(prompt)), rows


@pytest.mark.parametrize("end", [1, 20, 63, 64, 5 * GRID, 5 * GRID + 1, 5 * GRID + 20, 5 * GRID + 63])
def test_a_prompts_last_step_has_one_shape_cold_warm_and_after_a_longer_prompt(end: int) -> None:
    """Exact mode: the prompt's last prefill step is the cell holding its last token plus, when
    that cell is partial and has one, the full cell before it (64 + r rows: llama.cpp's tiled
    flash attention kernel, not the slow one for under 64 query rows), in a pass of its own;
    a full last cell or a one-cell prompt alone. Cold (under any budget), warm (the same prompt
    again) and after a longer prompt that holds it all in the cache, that pass has the same
    shape, and reuse stops at its start."""
    prompt = [WORD0 + (i * 7) % 50 for i in range(end)]
    start = last_step(end)
    r = end % GRID
    assert start == (end - GRID - r if r and end > GRID else (end - 1) // GRID * GRID)
    ex, eng = _grid_ex()
    cold, step, rows = _serve(ex, eng, prompt, 0)
    seq = step[0][0]
    expected = [(seq, start, end - start)]
    assert cold == 0 and step == expected
    assert end - start == (GRID + r if r and end > GRID else min(end, GRID) if r else GRID)
    # a smaller budget changes how many whole cells share the earlier steps, not the last one
    ex2, eng2 = _grid_ex()
    _cached, small, rows_small = _serve(ex2, eng2, prompt, 0, budget=7)
    assert small == [(small[0][0], start, end - start)] and rows_small == rows
    # warm: the same prompt again draws from its kept KV and last-step logits (a tail hit), no pass
    # (a one-token prompt has no prefill step: its token is a decode row, and nothing is kept)
    warm, step, rows_warm = _serve(ex, eng, prompt, 1)
    assert (warm, step is None) == ((end, True) if end > 1 else (0, False)) and rows_warm == rows
    # without them (dropped for room) it computes the last step in the one shape
    _drop_tails(ex)
    warm, step, rows_warm = _serve(ex, eng, prompt, 2)
    assert warm == start and step == [(step[0][0], start, end - start)] and rows_warm == rows
    # the cache holds more than the prompt (a longer prompt that contains it): still cut at the step
    ex3, eng3 = _grid_ex()
    _serve(ex3, eng3, prompt + [WORD0 + 49] * (2 * GRID + 5), 0)
    after, step, rows_after = _serve(ex3, eng3, prompt, 1)
    assert after == start and step == [(step[0][0], start, end - start)] and rows_after == rows


def test_a_copy_and_a_host_import_stop_at_the_new_prompts_last_step() -> None:
    """A prefix copied from another sequence, or imported from host memory, is cut at the
    start of the new prompt's last step too (every place a reuse is cut to whole cells)."""
    base = [WORD0 + (i * 3) % 50 for i in range(6 * GRID + 20)]
    ex, eng = _grid_ex(n_seq=3)
    ex.max_lanes = 2
    _serve(ex, eng, base, 0)                       # one sequence holds its 6 whole cells
    ex.admit(make_admit(1, base, max_new=50))      # the same prompt, live on that sequence
    copy = ex.admit(make_admit(2, base[: 5 * GRID + 30], max_new=2))   # copied from it
    assert copy.seq != ex.lanes[1].seq and copy.cached == last_step(5 * GRID + 30) == 4 * GRID
    drain(ex)
    # host memory: the only sequence, overwritten by another prompt, then asked again
    ex, eng = _grid_ex(n_seq=1, host=64 << 20)
    _serve(ex, eng, base, 0)
    _serve(ex, eng, [WORD0 + 45] * (3 * GRID), 1)
    assert len(ex.host) == 1
    tail = base[: 5 * GRID + 7]
    cached, step, _rows = _serve(ex, eng, tail, 2)
    assert ex.host.stats["hits"] == 1
    assert cached == last_step(len(tail)) == 4 * GRID and step == [(0, 4 * GRID, GRID + 7)]


def test_a_tail_is_kept_only_from_a_lone_last_step_and_only_for_its_salt() -> None:
    """Exact mode keeps a finished prompt's logits (its tail) only when its last step ran alone,
    the one shape a lone cold request computes; the same prompt under another cache salt is no
    tail hit (nor any other reuse)."""
    prompt = [WORD0 + (i * 7) % 50 for i in range(4 * GRID + 20)]   # (kept aside when overwritten: DEMOTE_MIN)
    ex, eng = _grid_ex(n_seq=4)
    ex.max_lanes = 2
    # two lanes whose last steps share a pass: neither keeps a tail
    ex.admit(make_admit(0, prompt, max_new=2))
    ex.admit(make_admit(1, prompt[:GRID] + [WORD0 + 3] * (3 * GRID + 20), max_new=2))
    drain(ex, budget=4096)
    assert any(len(step) == 2 and all(p + n == len(prompt) for _s, p, n in step) for step in eng.steps)
    assert not ex._tails
    again = ex.admit(make_admit(2, prompt, max_new=2))
    assert again.cached == last_step(len(prompt)) and again.primed is None
    drain(ex)
    # that one ran alone: kept; another salt's identical prompt is no hit
    assert len(ex._tails) == 1
    other = ex.admit(attrs.evolve(make_admit(3, prompt, max_new=2), cache_salt="other"))
    assert other.cached == 0 and other.primed is None
    drain(ex)
    hit = ex.admit(make_admit(4, prompt, max_new=2))
    assert hit.cached == len(prompt) and hit.primed is not None


def test_tails_stay_within_their_budget_oldest_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept logits of all sequences stay within ``TAIL_BYTES`` (the mock's count one byte
    each): the oldest prompt's tail goes, and that prompt reuses whole cells again."""
    monkeypatch.setattr(_executor, "TAIL_BYTES", 2)
    ex, _eng = _grid_ex(n_seq=4)
    # (over DEMOTE_MIN tokens: each next prompt moves the one before to a spare sequence, its tail too)
    prompts = [[WORD0 + k] + [WORD0 + (i * 7 + k) % 50 for i in range(4 * GRID + 9)] for k in range(4)]
    for k, p in enumerate(prompts):
        ex.admit(make_admit(k, p, max_new=2))
        drain(ex)
    assert len(ex._tails) == 2 and ex._tail_bytes == 2
    old = ex.admit(make_admit(10, prompts[0], max_new=2))
    assert old.cached == last_step(len(prompts[0])) and old.primed is None
    drain(ex)
    new = ex.admit(make_admit(11, prompts[3], max_new=2))
    assert new.cached == len(prompts[3])


def test_a_tail_goes_with_its_kv() -> None:
    """A sequence whose KV is replaced (a slot restore or erase, a host import, a lane taking
    it) no longer has a tail: kept logits are only ever drawn beside the KV that gave them."""
    prompt = [WORD0 + (i * 5) % 50 for i in range(2 * GRID + 30)]
    ex, _eng = _grid_ex(n_seq=2)
    ex.admit(make_admit(0, prompt, max_new=2))
    drain(ex)
    (seq,) = ex._tails
    assert ex.slots[seq].tail is not None
    ex._set_held(seq, list(prompt))   # (what a slot restore or import does to the sequence)
    assert ex.slots[seq].tail is None and not ex._tails
    again = ex.admit(make_admit(1, prompt, max_new=2))
    assert again.primed is None


def test_deterministic_mode_keeps_its_last_cell_alone() -> None:
    """Deterministic mode (flash attention off) keeps one cell a step, the last (partial) one
    alone, and a warm lane reuses every whole cell before it."""
    engine = _StepRecorder("mock?step_ms=0&prefill_us=0&n_ctx=4096&eos_every=1000000", n_seq=2)
    ex = Executor(engine, max_lanes=1, deterministic=True)
    prompt = [WORD0 + i % 50 for i in range(3 * GRID + 20)]
    for lane, cached in ((0, 0), (1, 3 * GRID)):
        got, step, _rows = _serve(ex, engine, prompt, lane)
        assert got == cached and step == [(step[0][0], 3 * GRID, 20)]
        _drop_tails(ex)
