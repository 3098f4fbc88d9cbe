"""Prompt-lookup speculation: drafting, exact verification, the gates (worker/_spec.py).

The executor runs over the mock engine, which refuses any decode that does not continue
its sequence exactly, so a rejected draft left in a lane's KV fails the next round. The
mock's ``copy`` option makes it repeat what followed the last earlier occurrence of its
last three tokens (a share of the time), as a model copying its prompt does; the gates
are judged on a virtual clock that a wrapper engine advances by a cost model per pass.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Any

import pytest

from superfluid.client import aiter_sse
from superfluid.suite._client import metric_sum

from superfluid.proto import SPEC_FLAGS, Admit, Emit, Sampling, SpecConfig
from superfluid.worker import _spec
from superfluid.worker._executor import Executor
from superfluid.worker._mock import WORD0, WORDS, MockEngine
from superfluid.worker._spec import Lookup

from .conftest import GEMMA_GGUF, MLX_DIR, REAL_GGUF, mock_config, open_daemon, stream_text, worker_pids

GREEDY = Sampling(temperature=0.0)
ALWAYS = SpecConfig(throughput_gate=False, adaptive=False, min_yield=0.0)   # draft every round, depth 4
COPY = "mock?step_ms=0&prefill_us=0&n_ctx=2048&eos_every=1000&copy=0.8"


def words(*ids: int) -> list[int]:
    return [WORD0 + i % len(WORDS) for i in ids]


# a "document" the reply copies from: a prompt with a long repeated passage
DOC = words(*range(40), *range(3, 30), *range(7, 19))


def run(ex: Executor, admits: list[Admit], max_steps: int = 20_000) -> dict[int, list[tuple[int, Any]]]:
    for a in admits:
        ex.admit(a)
    out: dict[int, list[tuple[int, Any]]] = {a.lane: [] for a in admits}
    for _ in range(max_steps):
        if not ex.lanes:
            return out
        res = ex.step(prefill_budget=512)
        assert not res.faults, res.faults
        for row in res.emits:
            out[row[0]].append((row[1], row[3]))
    raise AssertionError("lanes did not finish")


def admits(sampling: Sampling, n: int = 3, max_new: int = 120) -> list[Admit]:
    return [Admit(lane=i, tokens=[*DOC, *words(i, 2 * i + 1)], n_prompt=len(DOC) + 2, max_new=max_new,
                  sampling=sampling if i != 2 else Sampling(temperature=0.0, n_logprobs=2), ignore_eos=True)
            for i in range(n)]


# -- drafting --------------------------------------------------------------------------------------------------


def test_lookup_drafts_what_followed_the_last_earlier_trigram_else_bigram() -> None:
    look = Lookup()
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert look.draft(tokens, 3) == [7, 8, 1]          # the *last* earlier "1 2 3" (at 4), not the first
    tokens += [7]
    assert look.draft(tokens, 4) == [8, 1, 2, 3]       # "2 3 7" occurred once: what followed it
    tokens += [5, 8]                                   # "5 8" and "7 5 8" never occurred; "8" alone is no draft
    assert look.draft(tokens, 4) == []
    tokens += [1]                                      # "5 8 1" no; "8 1" yes (at 8-9): what followed it
    assert look.draft(tokens, 2) == [2, 3]
    assert Lookup().draft([4, 4], 3) == []             # nothing earlier
    assert Lookup().draft([4, 4, 4], 3) == [4]         # "4 4" ended at 2 before: one token follows


# -- exactness -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.9, seed=77),
                                      Sampling(temperature=0.0, repeat_penalty=1.3)],
                         ids=["greedy", "seeded", "penalties"])
def test_output_with_drafts_is_the_output_without(sampling: Sampling) -> None:
    """Three lanes (one a logprobs lane, which never drafts but rides in the same padded rows):
    every token and finish is what plain decoding gives, drafts were accepted and rejected."""
    plain = run(Executor(MockEngine(COPY, n_seq=5), max_lanes=3), admits(sampling))
    ex = Executor(MockEngine(COPY, n_seq=5), max_lanes=3, speculate=ALWAYS)
    drafted = run(ex, admits(sampling))
    assert drafted == plain
    assert all(len(rows) == 120 for rows in plain.values())
    gates = ex.gates
    assert gates is not None and gates.totals["rounds"] > 0
    # greedy copies 80% of the time; a seeded draw takes the copy a quarter of that
    assert 0 < gates.totals["accepted"] < gates.totals["proposed"]
    if sampling.greedy:
        assert gates.totals["accepted"] > gates.totals["proposed"] / 3
    # fewer forward passes than tokens: the accepted drafts came out of one pass each
    assert gates.totals["rounds"] < 2 * 120


def test_only_plain_lanes_never_draft() -> None:
    ex = Executor(MockEngine(COPY, n_seq=5), max_lanes=3, speculate=ALWAYS)
    for i, s in enumerate([Sampling(n_logprobs=0), Sampling(logit_bias=((WORD0, 2.0),)),
                           Sampling(temperature=2.0)]):
        ex.admit(Admit(lane=i, tokens=DOC, n_prompt=len(DOC), max_new=4, sampling=s))
    assert [ln.spec is None for ln in ex.lanes.values()] == [True, True, False]
    capped = Executor(MockEngine(COPY, n_seq=5), max_lanes=3,
                      speculate=SpecConfig(max_temperature=1.0))
    capped.admit(Admit(lane=0, tokens=DOC, n_prompt=len(DOC), max_new=4, sampling=Sampling(temperature=2.0)))
    assert capped.lanes[0].spec is None


def test_a_finished_drafting_lane_reports_its_counts_on_the_finish_row() -> None:
    ex = Executor(MockEngine(COPY, n_seq=5), max_lanes=1, speculate=ALWAYS)
    ex.admit(admits(GREEDY, 1)[0])
    last: list[Any] = []
    while ex.lanes:
        res = ex.step(prefill_budget=512)
        last = res.emits[-1] if res.emits else last
    assert last[3] == "length" and len(last) == 6
    proposed, accepted = last[5]
    assert 0 < accepted <= proposed
    Emit(items=[last])   # the wire form takes it
    with pytest.raises(ValueError):
        Emit(items=[[0, 5, b"x", None, None, [3, 1]]])   # only a finish row carries counts


def test_sampled_verification_accepts_a_draft_with_its_probability(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mock draws uniformly among four candidates: a one-token draft of one of them is
    accepted with probability 1/4, and a rejection draws the other three uniformly."""
    draft: list[int] = []
    monkeypatch.setattr(Lookup, "draft", lambda self, tokens, depth: list(draft))
    accepted, rejected = 0, Counter[int]()
    n = 0
    for seed in range(2000):
        ex = Executor(MockEngine(COPY.replace("copy=0.8", "copy=0"), n_seq=4), max_lanes=1,
                      speculate=SpecConfig(throughput_gate=False, adaptive=False, depth=1, min_yield=0.0))
        ex.admit(Admit(lane=0, tokens=words(5, 6, 7, 8), n_prompt=4, max_new=3,
                       sampling=Sampling(temperature=1.0, seed=seed)))
        ex.step(prefill_budget=512)        # the prompt, and the first token
        lane = ex.lanes[0]
        cands = lane.sampler._candidates(tuple(lane.tokens), 1)   # what the next draw chooses among
        if len(set(cands)) < 4:
            continue   # a repeated candidate has more than 1/4: keep the uniform cases
        n += 1
        draft[:] = [cands[1]]
        res = ex.step(prefill_budget=512)  # one drafting round
        first = res.emits[0][1]
        if first == cands[1]:
            accepted += 1
            assert len(res.emits) == 2     # and the pass's next position gave one more token
        else:
            rejected[cands.index(first)] += 1
            assert len(res.emits) == 1
    assert n > 1500
    assert abs(accepted / n - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5
    assert set(rejected) == {0, 2, 3}
    expected = (n - accepted) / 3
    chi2 = sum((rejected[i] - expected) ** 2 / expected for i in (0, 2, 3))
    assert chi2 < 13.8   # two degrees of freedom, p = 0.001


# -- the gates, on a virtual clock ----------------------------------------------------------------------------


class Clocked:
    """A mock engine whose passes advance a virtual clock: ``base`` seconds a decode pass plus
    ``per_draft`` for every extra token of a speculative row."""

    def __init__(self, spec: str, *, base: float, per_draft: float) -> None:
        self.inner = MockEngine(spec, n_seq=6)
        self.now = 0.0
        self.base, self.per_draft = base, per_draft

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, rows: list[Any], abort: Any = None) -> list[Any]:
        self.now += self.base + self.per_draft * sum(len(r.tokens) - 1 for r in rows if r.all_logits)
        return self.inner.decode(rows)

    def clock(self) -> float:
        return self.now


def gated(per_draft: float, config: SpecConfig, spec: str = COPY) -> tuple[Executor, Clocked]:
    eng = Clocked(spec, base=0.010, per_draft=per_draft)
    return Executor(eng, max_lanes=4, speculate=config, clock=eng.clock), eng  # type: ignore[arg-type]


def test_the_throughput_gate_keeps_drafting_where_it_pays() -> None:
    ex, _eng = gated(0.001, SpecConfig(probe_rounds=8))
    run(ex, admits(GREEDY, 1, max_new=200))
    gates = ex.gates
    assert gates is not None and gates.counts[1].verdict == "on"
    assert gates.counts[1].speedup >= 1.08
    assert gates.snapshot()["counts"][1][0] == "on"
    # "on" is measured again after --spec-gate-reprobe admissions (the workload may change)
    for _ in range(SpecConfig().reprobe):
        assert gates.counts[1].verdict == "on"
        gates.admitted()
    assert gates.counts[1].verdict == "probe"


def test_the_throughput_gate_decodes_plainly_where_drafts_cost_more_and_reprobes_on_schedule() -> None:
    config = SpecConfig(probe_rounds=8, reprobe=3, reprobe_max=6)
    ex, _eng = gated(0.010, config)    # every draft token costs a whole pass: it cannot pay
    run(ex, admits(GREEDY, 1, max_new=200)[:1])
    gates = ex.gates
    assert gates is not None
    count = gates.counts[1]
    assert count.verdict == "off" and count.speedup < 1.0 and count.interval == 3
    rounds = gates.totals["rounds"]
    # off: later requests decode plainly until the re-probe is due (3 admissions)
    for _ in range(2):
        run(ex, [Admit(lane=9, tokens=DOC, n_prompt=len(DOC), max_new=30, sampling=GREEDY)])
        assert gates.totals["rounds"] == rounds and count.verdict == "off"
    run(ex, [Admit(lane=9, tokens=DOC, n_prompt=len(DOC), max_new=60, sampling=GREEDY)])
    assert gates.totals["rounds"] > rounds                 # the third admission re-probed
    assert count.verdict == "off" and count.interval == 6  # failed again: the interval doubled (capped at 6)
    for _ in range(3):
        run(ex, [Admit(lane=9, tokens=DOC, n_prompt=len(DOC), max_new=60, sampling=GREEDY)])
    assert count.interval == 6   # capped at --spec-gate-reprobe-max


def test_the_yield_floor_stops_a_lane_whose_drafts_fail_and_two_such_abandon_speculation() -> None:
    config = SpecConfig(throughput_gate=False, adaptive=False, yield_rounds=6, min_yield=0.75)
    # the model repeats what followed 30% of the time: drafts are proposed and mostly rejected
    rarely = COPY.replace("copy=0.8", "copy=0.3")
    ex, _eng = gated(0.0, config, spec=rarely)
    run(ex, [Admit(lane=0, tokens=DOC, n_prompt=len(DOC), max_new=100, sampling=GREEDY)])
    gates = ex.gates
    assert gates is not None and gates.failing == 1 and not gates.abandoned
    run(ex, [Admit(lane=0, tokens=DOC, n_prompt=len(DOC), max_new=100, sampling=GREEDY)])
    assert gates.failing == 2 and gates.abandoned
    before = gates.totals["rounds"]
    run(ex, [Admit(lane=0, tokens=DOC, n_prompt=len(DOC), max_new=40, sampling=GREEDY)])
    assert gates.totals["rounds"] == before   # abandoned for good


def test_rounds_a_drafter_had_nothing_for_are_not_judged() -> None:
    """A round without a draft is a plain round: it costs nothing, so the yield floor does not
    count it (counting it stopped prompt-lookup on MLX, where it paid 1.5x: a reply drafts only
    where it copies)."""
    config = SpecConfig(throughput_gate=False, adaptive=False, yield_rounds=6, min_yield=0.75)
    ex, _eng = gated(0.0, config, spec=COPY.replace("copy=0.8", "copy=0"))
    run(ex, [Admit(lane=0, tokens=DOC, n_prompt=len(DOC), max_new=100, sampling=GREEDY)])
    gates = ex.gates
    assert gates is not None and gates.totals["rounds"] < 6 < gates.totals["plain_rounds"]
    assert gates.failing == 0 and not gates.abandoned


def test_a_passing_request_keeps_speculation_alive() -> None:
    config = SpecConfig(throughput_gate=False, adaptive=False, yield_rounds=6, min_yield=0.75)
    ex, _eng = gated(0.0, config, spec=COPY.replace("copy=0.8", "copy=1"))
    run(ex, admits(GREEDY, 1, max_new=80))
    gates = ex.gates
    assert gates is not None and gates.passing == 1 and gates.failing == 0


def test_adaptive_depth_prefers_shallow_drafts_when_deep_ones_are_rejected() -> None:
    """At 50% acceptance per position and a draft token costing 40% of a pass, depth 1 gives
    (1 + 0.5) / 1.4 = 1.07 tokens a pass-time against (1 + 0.5 + 0.25 + 0.125 + 0.06) / 2.6 = 0.74
    at depth 4: the measured choice is shallow."""
    gates = _spec.Gates(SpecConfig(throughput_gate=False, depth=4))
    for i in range(1, 5):
        gates.positions[i] = [100 * 2 ** (i - 1), 50 * 2 ** (i - 1)]   # 50% at every position
    count = gates.counts.setdefault(1, _spec._Count())
    count.cost = {0: [10, 0.10], 1: [10, 0.14], 2: [10, 0.18], 3: [10, 0.22], 4: [10, 0.26]}
    picks = Counter(gates.depth(1) for _ in range(32))
    assert picks.most_common(1)[0][0] == 1
    for i in range(1, 5):
        gates.positions[i] = [100, 98]   # nearly every draft token accepted: deep pays
    assert Counter(gates.depth(1) for _ in range(32)).most_common(1)[0][0] == 4


# -- the daemon -------------------------------------------------------------------------------------------------

DOC_TEXT = " ".join(["the worker writes every token before a client sees it, and the daemon keeps the lane"] * 3)
DAEMON_MOCK = "mock?step_ms=2&prefill_us=5&eos_every=1000&copy=0.9"
CHAT = {"model": "mock", "messages": [{"role": "user", "content": DOC_TEXT}], "max_tokens": 160,
        "ignore_eos": True, "temperature": 0}


async def test_the_daemon_drafts_reports_the_counts_and_a_killed_worker_changes_nothing() -> None:
    async with open_daemon(mock_config(DAEMON_MOCK)) as plain:
        reference = (await plain.client.post("/v1/chat/completions", json=CHAT)).json()
    assert "superfluid" not in reference
    text = reference["choices"][0]["message"]["content"]
    async with open_daemon(mock_config(DAEMON_MOCK, speculate="prompt-lookup", spec_gates=ALWAYS)) as d:
        models = (await d.client.get("/v1/models")).json()["data"]
        assert models[0]["capabilities"]["speculation"] == "prompt-lookup"
        whole = (await d.client.post("/v1/chat/completions", json=CHAT)).json()
        assert whole["choices"][0]["message"]["content"] == text
        spec = whole["superfluid"]["spec"]
        assert 0 < spec["accepted"] <= spec["proposed"]
        assert spec["acceptance_rate"] == round(spec["accepted"] / spec["proposed"], 3)
        # streamed: the same text, the counts on the final chunk; a worker killed a quarter of the way
        [pid] = worker_pids()
        events: list[dict[str, Any]] = []
        async with d.client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            killed = False
            async for event in aiter_sse(r.aiter_bytes()):
                if event.data == "[DONE]":
                    break
                if event.data:
                    events.append(event.json())
                    if not killed and len(stream_text(events)) >= len(text) // 4:
                        os.kill(pid, signal.SIGKILL)
                        killed = True
        assert killed and not any("error" in e for e in events)
        assert stream_text(events) == text
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert "spec" in events[-1].get("superfluid", {})   # counted by the worker that finished it
        metrics = (await d.client.get("/metrics")).text
        assert (metric_sum(metrics, "superfluid_spec_accepted_total", model="mock") or 0) >= spec["accepted"]
        assert (metric_sum(metrics, "superfluid_spec_proposed_total", model="mock") or 0) >= spec["proposed"]
        assert "superfluid_spec_gate_state{" in metrics
        # continuous usage: every chunk counts the tokens so far (a chunk may carry several)
        async with d.client.stream("POST", "/v1/chat/completions", json={
                **CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}) as r:
            counts = [e["usage"]["completion_tokens"] async for e in _events(r) if e["choices"][0]["delta"]]
        steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
        assert counts == sorted(counts) and counts[-1] == 160 and max(steps) > 1
        # a completion reports too
        done = (await d.client.post("/v1/completions", json={"model": "mock", "prompt": DOC_TEXT, "max_tokens": 60,
                                                             "ignore_eos": True, "temperature": 0})).json()
        assert done["superfluid"]["spec"]["proposed"] > 0


async def _events(r: Any) -> Any:
    async for event in aiter_sse(r.aiter_bytes()):
        if event.data and event.data != "[DONE]":
            yield event.json()


async def test_a_runtime_that_cannot_verify_drafts_refuses_prompt_lookup_and_auto_decodes_plainly() -> None:
    from superfluid.nursery import WorkerLoadFailed

    refusing = DAEMON_MOCK + "&drafts=0"   # as the basert runtime does today
    with pytest.raises(BaseException) as info:  # noqa: PT011 - the daemon's startup failure
        async with open_daemon(mock_config(refusing, speculate="prompt-lookup")):
            pass
    assert info.group_contains(WorkerLoadFailed, match="^--speculate prompt-lookup: the mock runtime was started "
                                                      "with drafts=0$", depth=2)
    async with open_daemon(mock_config(refusing, speculate="auto")) as d:
        models = (await d.client.get("/v1/models")).json()["data"]
        assert models[0]["capabilities"]["speculation"] == "the mock runtime was started with drafts=0"
        r = (await d.client.post("/v1/chat/completions", json=CHAT)).json()
        assert "superfluid" not in r and r["usage"]["completion_tokens"] == 160


# -- the real runtimes -----------------------------------------------------------------------------------------

REAL_PROMPTS = (
    # copies: the reply repeats its context
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape, honeydew. The same list again: apple,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# the same two functions:\ndef add(a, b):",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,",
    '{"name": "Ada", "age": 36, "city": "London"}\n{"name": "Alan", "age": 41, "city": "London"}\n{"name":',
    # free text: little to copy
    "The capital of France is",
    "Once upon a time, in a small village,",
    "Explain why the sky is blue:",
    "Write a haiku about the sea:",
    "The three laws of motion are",
    "A recipe for pancakes:",
)


def _greedy_runs(engine: Any, prompts: tuple[str, ...], *, lanes: int, speculate: SpecConfig | None,
                 max_new: int = 48) -> tuple[list[list[int]], Any]:
    for seq in range(engine.info.n_seq):
        engine.seq_rm(seq, 0, -1)   # a new executor starts from empty KV
    ex = Executor(engine, max_lanes=lanes, speculate=speculate)
    outs: list[list[int]] = []
    for start in range(0, len(prompts), lanes):
        batch = [Admit(lane=i, tokens=engine.tokenize(p, add_special=True, parse_special=False),
                       n_prompt=len(engine.tokenize(p, add_special=True, parse_special=False)), max_new=max_new,
                       sampling=GREEDY) for i, p in enumerate(prompts[start:start + lanes])]
        got = run(ex, batch)
        outs += [[tok for tok, finish in got[a.lane] if finish != "eos"] for a in batch]
    gates = ex.gates
    ex.close()
    return outs, gates


# logits: llama.cpp computes a drafting row in another kernel shape than a 1-token decode; on Gemma 3
# (Q4_K_M) picks parted at measured margins of 0.06, 0.10 and 0.17 (3 of 6 prompts, 32 tokens each)
NEAR_TIE = 0.25


def _same_or_near_tie(engine: Any, prompt: str, plain: list[int], drafted: list[int]) -> tuple[bool, str]:
    """True if the two greedy outputs are equal, or part only where plain decoding's two
    candidates were within ``NEAR_TIE`` of each other (numerically a tie: batching plain lanes
    flips such picks too). A wrong verification parts them where one candidate clearly wins."""
    from superfluid.worker._engine import BatchRow

    if plain == drafted:
        return True, "identical"
    j = next(i for i, (a, b) in enumerate(zip(plain, drafted, strict=False)) if a != b)
    tokens = engine.tokenize(prompt, add_special=True, parse_special=False) + plain[:j]
    for seq in range(engine.info.n_seq):
        engine.seq_rm(seq, 0, -1)
    [out] = engine.decode([BatchRow(seq=0, tokens=tuple(tokens), pos0=0, want_logits=True)])
    logits = engine.logits(out)
    margin = abs(float(logits[plain[j]]) - float(logits[drafted[j]]))
    engine.seq_rm(0, 0, -1)
    return margin < NEAR_TIE, f"parted at token {j}: logit margin {margin:.4f}"


@pytest.mark.real
def test_llamacpp_greedy_output_with_drafts_is_the_output_without() -> None:
    from superfluid.worker._llamacpp import LlamaEngine

    engine = LlamaEngine(str(REAL_GGUF), max_batch=4, max_context=1024, threads=2)
    try:
        assert engine.drafts is True
        for lanes, prompts in ((1, REAL_PROMPTS[::2]), (4, REAL_PROMPTS)):
            plain, _ = _greedy_runs(engine, prompts, lanes=lanes, speculate=None)
            drafted, gates = _greedy_runs(engine, prompts, lanes=lanes, speculate=ALWAYS)
            for prompt, a, b in zip(prompts, plain, drafted, strict=True):
                same, how = _same_or_near_tie(engine, prompt, a, b)
                assert same, f"{lanes} lanes, {prompt!r}: {how}"
            assert gates is not None and gates.totals["accepted"] > 0.3 * gates.totals["proposed"]
    finally:
        engine.close()


@pytest.mark.real(MLX_DIR)
def test_mlx_greedy_output_with_drafts_is_the_output_without() -> None:
    """MLX runs a drafting round as one batched pass (rows of equal width, each query masked
    causally over its own left-padded keys) and trims a rejected tail from the lane's caches."""
    from superfluid.worker._mlx import MlxEngine

    engine = MlxEngine(str(MLX_DIR), max_batch=3, max_context=512)
    try:
        assert engine.drafts is True
        for lanes, prompts in ((1, REAL_PROMPTS[:6:2]), (3, REAL_PROMPTS[:6] + REAL_PROMPTS[6::2])):
            plain, _ = _greedy_runs(engine, prompts, lanes=lanes, speculate=None, max_new=32)
            drafted, gates = _greedy_runs(engine, prompts, lanes=lanes, speculate=ALWAYS, max_new=32)
            verdicts = [_same_or_near_tie(engine, p, a, b) for p, a, b in zip(prompts, plain, drafted, strict=True)]
            assert all(same for same, _how in verdicts), (lanes, verdicts)
            assert gates is not None and gates.totals["accepted"] > 0.3 * gates.totals["proposed"]
    finally:
        engine.close()


@pytest.mark.real(GEMMA_GGUF)
def test_gemma_refuses_drafts_in_its_shared_pool_and_verifies_them_exactly_per_sequence() -> None:
    """Gemma 3's sliding-window KV in llama.cpp's shared pool cannot drop a rejected draft:
    prompt-lookup is refused in the runtime's words and ``auto`` decodes plainly. With one
    full stream per sequence (the layout --deterministic uses) it can, and drafts are exact."""
    import argparse

    from superfluid.worker._llamacpp import LlamaEngine
    from superfluid.worker._main import resolve_speculation

    def args(directive: str, deterministic: bool = False) -> argparse.Namespace:
        return argparse.Namespace(speculate=directive, deterministic=deterministic, runtime="llamacpp",
                                  **{f"spec_{name}": None for name in SPEC_FLAGS})

    shared = LlamaEngine(str(GEMMA_GGUF), max_batch=2, max_context=512, threads=2)
    try:
        assert shared.info.kv_layout == "shared"
        config, said = resolve_speculation(args("auto"), shared)
        assert config is None and "cannot drop a rejected draft" in said
        with pytest.raises(ValueError):
            Executor(shared, max_lanes=2, speculate=ALWAYS)
    finally:
        shared.close()
    per_seq = LlamaEngine(str(GEMMA_GGUF), max_batch=2, max_context=512, threads=2, deterministic=True)
    try:
        config, said = resolve_speculation(args("prompt-lookup"), per_seq)
        assert config is not None and said == "prompt-lookup"
        assert resolve_speculation(args("prompt-lookup", deterministic=True), per_seq)[0] is None
        prompts = REAL_PROMPTS[:4] + REAL_PROMPTS[6:8]
        plain, _ = _greedy_runs(per_seq, prompts, lanes=2, speculate=None, max_new=32)
        drafted, gates = _greedy_runs(per_seq, prompts, lanes=2, speculate=ALWAYS, max_new=32)
        verdicts = [_same_or_near_tie(per_seq, p, a, b) for p, a, b in zip(prompts, plain, drafted, strict=True)]
        assert all(same for same, _how in verdicts), verdicts
        assert sum(how == "identical" for _same, how in verdicts) >= len(prompts) // 2, verdicts
        assert gates is not None and gates.totals["accepted"] > 0
    finally:
        per_seq.close()


def test_a_clear_loss_ends_a_probe_early_and_larger_lane_counts_inherit_the_verdict() -> None:
    gates = _spec.Gates(SpecConfig(probe_rounds=16, reprobe=5))
    for n in (2, 4):
        gates.depth(n)   # seen, probing
    for _ in range(_spec.EARLY_ROUNDS):
        gates.record(2, 0, 2, 0.010)   # plain: 200 tokens/s
        gates.record(2, 4, 2, 0.020)   # drafting: 100 tokens/s, half as fast
    count = gates.counts[2]
    assert count.verdict == "off" and count.speedup == pytest.approx(0.5)   # 4 rounds a side, not 16
    assert gates.counts[4].verdict == "off" and gates.counts[4].wait == 5   # more lanes: off with it
    assert gates.depth(8) == 0 and gates.counts[8].verdict == "off"       # a new larger count starts off
    assert gates.depth(1) != 0 or gates.counts[1].verdict == "probe"      # a smaller one still probes
    for _ in range(5):
        gates.admitted()
    assert {n: c.verdict for n, c in gates.counts.items() if n != 1} == {2: "probe", 4: "probe", 8: "probe"}
