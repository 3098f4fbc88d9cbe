"""The llama.cpp primitive runtime, driven through the generic executor.

Contract checked: in deterministic mode (engine and executor, SPEC.md §5
"Determinism") greedy output does not depend on batch shape or batch splitting,
and seeded sampling is counter-based, so a resumed lane continues exactly; the
prefix cache (reuse of a finished sequence, a copy from a running one, host
memory, a demoted copy) seeds a lane with the cached whole grid cells and, alone,
its greedy continuation is the fresh one's (exact mode, the default over one KV
stream per sequence: the last cell is computed in one shape, SPEC.md §5
"Determinism"); beside a decoding lane it parts from it only at a near-tie; grammars constrain output and bad ones
are refused; logprobs have the documented shape; Gemma 3 loads as a shared pool.

Needs llama-cpp-python and GGUF files: ``SUPERFLUID_TEST_GGUF`` (default the
SmolLM2 135M file) and ``SUPERFLUID_TEST_GEMMA``.
"""

from __future__ import annotations

import json
import os

from superfluid.models._files import cache_dir
from collections.abc import Iterator
from typing import Any

import pytest

from superfluid.proto import Admit, Sampling
from superfluid.worker._executor import DEMOTE_MIN, Executor, last_step
from superfluid.worker._hostcache import HOST_MIN_TOKENS

from .test_speculation import _same_or_near_tie

pytestmark = pytest.mark.real

REQUIRE_REAL = os.environ.get("SUPERFLUID_REQUIRE_REAL") == "1"  # CI: a missing model fails, never skips

SMOL = os.environ.get("SUPERFLUID_TEST_GGUF", str(cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"))
GEMMA = os.environ.get("SUPERFLUID_TEST_GEMMA", str(cache_dir() / "gemma-3-270m-q4_k_m.gguf"))

PROMPTS = (
    "The capital of France is",
    "List three colours:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)


def _engine(path: str, *, max_context: int = 512, deterministic: bool = False) -> Iterator[Any]:
    if not os.path.isfile(path):
        if REQUIRE_REAL:
            pytest.fail(f"model file {path} is missing (python -m superfluid.models._files fetches it)")
        pytest.skip(f"model file {path} is missing")
    from superfluid.worker._llamacpp import LlamaEngine

    engine = LlamaEngine(path, max_batch=4, max_context=max_context, threads=2, deterministic=deterministic)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def smol() -> Iterator[Any]:
    yield from _engine(SMOL)


@pytest.fixture(scope="module")
def smol_det() -> Iterator[Any]:
    """SmolLM2 loaded deterministic (no flash attention, no repacked weights): with a
    deterministic executor a lane's output does not depend on its batch (SPEC.md §5
    "Determinism"); without, a row's logits depend on the rows beside it and on chunking."""
    yield from _engine(SMOL, deterministic=True)


@pytest.fixture(scope="module")
def gemma() -> Iterator[Any]:
    yield from _engine(GEMMA)


def fresh(engine: Any, *, deterministic: bool = False) -> Executor:
    """An executor over an empty KV (no prefix cache from earlier tests)."""
    for seq in range(engine.info.n_seq):
        engine.seq_rm(seq, 0, -1)
    return Executor(engine, max_lanes=4, deterministic=deterministic)


def assert_same_or_near_tie(engine: Any, text: str, reference: list[int], got: list[int]) -> None:
    """Greedy ``got`` is ``reference`` (computed fresh), or parts from it only where the
    fresh computation's two candidates were within a near-tie (test_speculation's
    NEAR_TIE). For comparisons across batch shapes without deterministic mode (SPEC.md §5
    "Determinism"). Clears the engine's KV: call it once the executor is done."""
    same, how = _same_or_near_tie(engine, text, reference, got)
    assert same, how


def prompt(engine: Any, text: str) -> list[int]:
    return engine.tokenize(text, add_special=True, parse_special=True)


def admit(ex: Executor, lane: int, tokens: list[int], *, n_prompt: int | None = None, max_new: int = 6,
          **sampling: Any) -> Any:
    return ex.admit(Admit(lane=lane, tokens=tokens, n_prompt=len(tokens) if n_prompt is None else n_prompt,
                          max_new=max_new, sampling=Sampling(**sampling), ignore_eos=True))


def drain(ex: Executor, out: dict[int, list[Any]] | None = None) -> dict[int, list[Any]]:
    """Step until no lane is left; emitted rows per lane."""
    out = {} if out is None else out
    while ex.lanes:
        res = ex.step(prefill_budget=1024)
        assert not res.faults, res.faults
        for row in res.emits:
            out.setdefault(row[0], []).append(row)
    return out


def tokens_of(rows: list[Any]) -> list[int]:
    return [row[1] for row in rows]


def test_model_info(smol: Any) -> None:
    info = smol.info
    assert info.architecture == "llama" and info.kv_layout == "per_seq"
    assert info.n_seq == 6 and info.n_ctx_seq == 512
    assert info.special_tokens["<|im_start|>"] == 1 and info.special_tokens["<|im_end|>"] in info.eog
    assert "<|im_start|>" in info.chat_template
    assert smol.piece(info.special_tokens["<|im_end|>"]) == b"<|im_end|>"
    caps = smol.capabilities()
    assert caps["grammar"] is True and caps["prefix_cache"] is True and caps["embeddings"] is True


def test_greedy_alone_equals_batched(smol_det: Any) -> None:
    smol = smol_det
    ex = fresh(smol, deterministic=True)
    admit(ex, 0, prompt(smol, PROMPTS[0]))
    alone = tokens_of(drain(ex)[0])
    ex = fresh(smol, deterministic=True)
    for lane, text in enumerate(PROMPTS):
        admit(ex, lane, prompt(smol, text))
    batched = drain(ex)
    assert tokens_of(batched[0]) == alone
    assert len({tuple(tokens_of(rows)) for rows in batched.values()}) == len(PROMPTS)


def test_split_batches_keep_outputs(smol_det: Any) -> None:
    smol = smol_det
    ex = fresh(smol, deterministic=True)
    for lane, text in enumerate(PROMPTS[:2]):
        admit(ex, lane, prompt(smol, text), max_new=4)
    whole = drain(ex)
    cap = smol._cap
    smol._cap = 5  # force every prefill step across several llama_decode calls
    try:
        ex = fresh(smol, deterministic=True)
        for lane, text in enumerate(PROMPTS[:2]):
            admit(ex, lane, prompt(smol, text), max_new=4)
        split = drain(ex)
    finally:
        smol._cap = cap
    assert {k: tokens_of(v) for k, v in split.items()} == {k: tokens_of(v) for k, v in whole.items()}


def whole_cells(n_prompt: int) -> int:
    """What a warm resend of an ``n_prompt``-token prompt reuses: the whole cells before its last
    prefill step (``last_step``: the cell holding its last token, with the full cell before it
    when that one is partial)."""
    return last_step(n_prompt)


def test_prefix_cache_reuses_finished_sequence(smol: Any) -> None:
    ex = fresh(smol)
    toks = prompt(smol, " ".join(PROMPTS * 8))
    first = admit(ex, 0, toks)
    assert first.cached == 0
    out1 = tokens_of(drain(ex)[0])
    # the same prompt again: its KV and its last step's logits were kept (a tail), nothing computed
    second = admit(ex, 1, toks)
    assert second.cached == len(toks) and second.primed is not None
    assert tokens_of(drain(ex)[1]) == out1
    # without the tail (dropped for room): the whole cells, its last step computed alone as cold
    for seq in list(ex._tails):
        ex._set_tail(seq, None)
    third = admit(ex, 2, toks)
    assert third.cached == whole_cells(len(toks)) > 0
    assert tokens_of(drain(ex)[2]) == out1


def test_seeded_sampling_from_kept_logits_draws_as_from_the_context(smol: Any) -> None:
    """A tail hit's first token is drawn from kept logits through the chain (``_sample_kept``),
    not from the context: seeded sampling gives the cold lane's tokens."""
    ex = fresh(smol)
    toks = prompt(smol, " ".join(PROMPTS * 4))
    for seed in (1, 2, 3):
        cold = admit(ex, 10 * seed, toks, max_new=6, **{**SEEDED, "seed": seed})
        assert cold.primed is None
        out_cold = tokens_of(drain(ex)[10 * seed])
        warm = admit(ex, 10 * seed + 1, toks, max_new=6, **{**SEEDED, "seed": seed})
        assert warm.primed is not None
        assert tokens_of(drain(ex)[10 * seed + 1]) == out_cold, seed
        for s in list(ex._tails):
            ex._set_tail(s, None)


def test_prefix_copied_from_running_lane(smol: Any) -> None:
    ex = fresh(smol)
    text = " ".join([PROMPTS[2]] * 32)
    toks = prompt(smol, text)  # more than its last step: copied, not prefilled again
    admit(ex, 0, toks, max_new=8)
    out: dict[int, list[Any]] = {}
    for _ in range(3):
        for row in ex.step(prefill_budget=1024).emits:
            out.setdefault(row[0], []).append(row)
    copy = admit(ex, 1, toks, max_new=8)
    assert copy.cached == whole_cells(len(toks)) > 0 and copy.seq != ex.lanes[0].seq
    drain(ex, out)
    # the two lanes decode in one batch: beside another lane, only a near-tie may part them
    assert_same_or_near_tie(smol, text, tokens_of(out[0]), tokens_of(out[1]))


SEEDED = {"temperature": 0.8, "seed": 1234, "top_k": 40, "top_p": 0.95, "repeat_penalty": 1.2}


def test_seeded_sampling_reproducible_and_resumable(smol_det: Any) -> None:
    # deterministic: the resumed lane's committed tokens are replayed one per decode round, as
    # first computed; re-prefilled in one chunk their logits would round differently (SPEC.md §5)
    smol = smol_det
    toks = prompt(smol, PROMPTS[1])
    runs = []
    for _ in range(2):
        ex = fresh(smol, deterministic=True)
        admit(ex, 0, toks, max_new=8, **SEEDED)
        runs.append(tokens_of(drain(ex)[0]))
    assert runs[0] == runs[1]
    ex = fresh(smol, deterministic=True)
    admit(ex, 0, prompt(smol, PROMPTS[1]), max_new=8, **{**SEEDED, "seed": 99})
    assert tokens_of(drain(ex)[0]) != runs[0]  # another seed, another draw (almost surely)
    k = 3
    ex = fresh(smol, deterministic=True)
    lane = admit(ex, 0, toks + runs[0][:k], n_prompt=len(toks), max_new=8, **SEEDED)
    assert lane.n_generated == k
    assert tokens_of(drain(ex)[0]) == runs[0][k:]


def test_grammar_constrains_output(smol_det: Any) -> None:
    # deterministic: the resumed lane replays its tokens one per decode round, as first computed
    smol = smol_det
    grammar = 'root ::= "{" ws "\\"answer\\":" ws ("true" | "false") ws "}"\nws ::= " "?\n'
    ex = fresh(smol, deterministic=True)
    tokens = prompt(smol, "<|im_start|>user\nIs the sky blue? Answer in JSON.<|im_end|>\n<|im_start|>assistant\n")
    ex.admit(Admit(lane=0, tokens=tokens, n_prompt=len(tokens), max_new=24, sampling=Sampling(grammar=grammar)))
    rows = drain(ex)[0]
    assert rows[-1][3] == "eos"
    text = b"".join(row[2] for row in rows).decode()
    assert isinstance(json.loads(text)["answer"], bool)
    # a resumed lane replays its tokens through the grammar and ends the same way
    done = tokens_of(rows)[:-1]
    ex = fresh(smol, deterministic=True)
    ex.admit(Admit(lane=1, tokens=tokens + done[:2], n_prompt=len(tokens), max_new=24,
                   sampling=Sampling(grammar=grammar)))
    assert tokens_of(drain(ex)[1]) == tokens_of(rows)[2:]
    # a history the grammar rejects is refused, not fed to llama.cpp (which would abort)
    with pytest.raises(ValueError, match="grammar"):
        ex.admit(Admit(lane=2, tokens=tokens + done[1:3], n_prompt=len(tokens), max_new=24,
                       sampling=Sampling(grammar=grammar)))


def test_invalid_grammar_is_refused(smol: Any) -> None:
    ex = fresh(smol)
    with pytest.raises(ValueError, match="grammar"):
        admit(ex, 0, prompt(smol, PROMPTS[0]), grammar="root ::= {")
    with pytest.raises(ValueError, match="grammar"):
        admit(ex, 0, prompt(smol, PROMPTS[0]), grammar='value ::= "a"')
    assert not ex.lanes


def test_logprobs_and_logit_bias(smol: Any) -> None:
    ex = fresh(smol)
    admit(ex, 0, prompt(smol, PROMPTS[0]), max_new=2, n_logprobs=3)
    rows = drain(ex)[0]
    for _lane, token, _piece, _finish, lp in rows:
        chosen, top = lp
        assert len(top) == 3 and chosen <= 0
        assert [t[0] for t in top][0] == token and top[0][2] == pytest.approx(chosen)
        assert all(isinstance(t, int) and isinstance(p, bytes) for t, p, _ in top)
        assert [t[2] for t in top] == sorted((t[2] for t in top), reverse=True)
    forced = smol.tokenize(" banana", add_special=False, parse_special=False)[0]
    ex = fresh(smol)
    admit(ex, 0, prompt(smol, PROMPTS[0]), max_new=2, logit_bias=[(forced, 100.0)])
    assert tokens_of(drain(ex)[0]) == [forced, forced]


def test_greedy_argmax_picks_what_the_sampler_chain_picks(smol: Any) -> None:
    """Stateless greedy sampling is a numpy argmax (bias added); it draws
    the token llama.cpp's chain draws, for every lane of a batch, with no bias,
    a ban on the best token, and a ban on end of generation (``ignore_eos``)."""
    import llama_cpp as L

    from superfluid.worker._engine import BatchRow

    seqs = [prompt(smol, p) for p in PROMPTS]
    for seq in range(smol.info.n_seq):
        smol.seq_rm(seq, 0, -1)
    outs = smol.decode([BatchRow(seq=i, tokens=tuple(t), pos0=0, want_logits=True) for i, t in enumerate(seqs)])
    best = [int(smol.logits(o).argmax()) for o in outs]
    for bias in ((), ((best[0], -100.0), (best[1], float("-inf"))), tuple((t, float("-inf")) for t in smol.info.eog)):
        for out in outs:
            fast = smol.new_sampler(Sampling(temperature=0.0, logit_bias=bias), [])
            chain = smol.new_sampler(Sampling(temperature=0.0, logit_bias=bias), [])
            assert fast._argmax
            try:
                assert fast.sample(out, 0) == int(L.llama_sampler_sample(chain._chain, smol._ctx, out))
            finally:
                fast.close()
                chain.close()
    penalized = smol.new_sampler(Sampling(temperature=0.0, repeat_penalty=1.1), [])
    assert not penalized._argmax
    penalized.close()


def test_gemma_shared_pool_generates(gemma: Any) -> None:
    assert gemma.info.architecture == "gemma3" and gemma.info.kv_layout == "shared"
    assert isinstance(gemma.capabilities()["prefix_cache"], str)
    toks = prompt(gemma, PROMPTS[0])
    ex = fresh(gemma)
    admit(ex, 0, toks, max_new=6)
    full = tokens_of(drain(ex)[0])
    assert len(full) == 6
    ex = fresh(gemma)
    for lane, text in enumerate(PROMPTS[:2]):
        admit(ex, lane, prompt(gemma, text), max_new=4)
    beside = tokens_of(drain(ex)[0])
    # a resumed lane extends the whole cached sequence (the only reuse a shared pool allows)
    resumed = admit(ex, 2, toks + full[:4], n_prompt=len(toks), max_new=6)
    assert resumed.n_past == len(toks) + 3 and resumed.cached == len(toks)
    rest = tokens_of(drain(ex)[2])
    # in a shared pool a row's logits depend on the cells the other sequences hold (SPEC.md §5
    # "Determinism"; this prompt's 5th greedy pick wins by 0.015): the same, or parted at a near-tie
    assert_same_or_near_tie(gemma, PROMPTS[0], full[:4], beside)
    assert_same_or_near_tie(gemma, PROMPTS[0], full, full[:4] + rest)


def test_a_prefix_exported_to_host_memory_continues_identically(smol: Any) -> None:
    """Fill every sequence with longer prompts until the first one is exported
    to host memory, import it back: the continuation equals a fresh prefill's."""
    text = " ".join(PROMPTS * 11)
    toks = prompt(smol, text)
    assert len(toks) >= HOST_MIN_TOKENS
    ex = fresh(smol)
    ex = Executor(smol, max_lanes=1, host_cache_bytes=256 << 20)
    admit(ex, 0, toks, max_new=6)
    reference_out = tokens_of(drain(ex)[0])
    for lane in range(1, 2 * smol.info.n_seq):
        if len(ex.host):
            break
        admit(ex, lane, prompt(smol, f"{lane} " + " ".join(PROMPTS * 13)), max_new=1)   # toks, the oldest, goes last
        drain(ex)
    assert len(ex.host) == 1
    back = admit(ex, 99, toks, max_new=6)
    assert back.cached == whole_cells(len(toks)) and ex.host.stats["hits"] == 1
    assert tokens_of(drain(ex)[99]) == reference_out


def test_a_demoted_prefix_copied_back_continues_identically(smol: Any) -> None:
    ex = fresh(smol)
    text = " ".join(PROMPTS * 11)
    first, second = prompt(smol, text), prompt(smol, "2 " + text)
    assert len(first) >= DEMOTE_MIN
    admit(ex, 0, first, max_new=6)
    reference_out = tokens_of(drain(ex)[0])
    for lane in range(1, smol.info.n_seq):    # every other sequence holds something (short prompts)
        admit(ex, 10 + lane, prompt(smol, f"Note {chr(64 + lane)}: {PROMPTS[0]}"), max_new=1)
        drain(ex)
    admit(ex, 1, first, max_new=1)            # first again: its sequence is now the newest
    drain(ex)
    admit(ex, 2, second, max_new=2)           # no empty sequence: lands on first's (the lowest); first moves aside
    drain(ex)
    assert ex.stats["demoted"] == 1
    back = admit(ex, 3, first, max_new=6)
    assert back.cached == len(first)   # the demoted copy carries its tail (the same KV)
    assert tokens_of(drain(ex)[3]) == reference_out


def test_embeddings_pool_as_asked_and_batch_into_one_decode(smol: Any) -> None:
    """SmolLM2 names no pooling: mean by default; ``--pooling last`` is another vector; several
    inputs go through in one llama_decode (a batch of 3 inputs costs one call)."""
    from superfluid.worker import _llamacpp
    from superfluid.worker._llamacpp import LlamaEngine

    assert smol.pooling() == "mean"
    texts = [smol.tokenize(t, add_special=True, parse_special=False) for t in ("a cat", "a dog", "stock prices")]
    calls = []
    real = _llamacpp.L.llama_decode

    def counting(ctx: Any, batch: Any) -> int:
        calls.append(batch.n_tokens)
        return real(ctx, batch)

    _llamacpp.L.llama_decode = counting
    try:
        dim, mean = smol.embed(texts, normalize=True)
    finally:
        _llamacpp.L.llama_decode = real
    assert dim == 576 and len(mean) == 3 and calls == [sum(map(len, texts))]
    last = LlamaEngine(str(SMOL), max_batch=1, max_context=64, threads=2, pooling="last")
    try:
        assert last.pooling() == "last"
        _, lasts = last.embed(texts[:1], normalize=True)
        assert lasts[0] != mean[0]
        with pytest.raises(ValueError, match="window is 64"):
            last.embed([[1] * 65], normalize=True)
    finally:
        last.close()


def test_an_aborted_pass_leaves_the_kv_as_it_was(gemma: Any) -> None:
    """``decode(rows, abort)``: llama.cpp's abort callback stops the pass midway, the
    pass's positions leave the KV (llama.cpp drops only the micro-batch it was in;
    the engine drops the earlier ones), and the same pass run again gives exactly
    the logits of a run that was never aborted. A shared pool (Gemma 3) ignores it."""
    import numpy as np

    from superfluid.worker._engine import BatchRow, StepAborted

    engine = next(_engine(SMOL, max_context=2048))
    toks = prompt(engine, " ".join(PROMPTS) * 40)[:1100]
    head, tail = tuple(toks[:64]), tuple(toks[64:])   # the tail: two 512-token micro-batches and a bit

    def run(seq: int, *, abort_after: int | None) -> tuple[Any, int]:
        engine.decode([BatchRow(seq=seq, tokens=head, pos0=0, want_logits=False)])
        polls = 0

        def abort() -> bool:
            nonlocal polls
            polls += 1
            return abort_after is not None and polls > abort_after
        if abort_after is not None:
            with pytest.raises(StepAborted):
                engine.decode([BatchRow(seq=seq, tokens=tail, pos0=64, want_logits=True)], abort)
            assert polls == abort_after + 1   # it stopped at the first True
            abort_after = None
        out = engine.decode([BatchRow(seq=seq, tokens=tail, pos0=64, want_logits=True)], abort)
        return np.array(engine.logits(out[0])), polls

    try:
        plain, polls = run(0, abort_after=None)
        assert polls > 100   # polled between the graph's nodes
        # in the second micro-batch
        assert np.array_equal(run(1, abort_after=polls * 6 // 10)[0], plain)
    finally:
        engine.close()
    # Gemma's shared pool cannot drop a pass's tail: the pass runs to its end
    fresh(gemma)
    g = prompt(gemma, PROMPTS[0])
    assert gemma.decode([BatchRow(seq=0, tokens=tuple(g), pos0=0, want_logits=True)], lambda: True) == [len(g) - 1]
