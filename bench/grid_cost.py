"""What the default mode's grid costs (issue 51): the in-process executor over llama.cpp, no daemon.

Usage::

    python bench/grid_cost.py --model PATH [--threads 2] [--repeats 3] [--long 5200]

Default settings over llama.cpp with one KV stream per sequence run the executor in exact mode
(``LlamaEngine.grid``; SPEC.md §5 "Determinism"): prompts prefilled in whole 64-position cells on
the absolute grid with the last step (the last cell, with the full cell before it when it is
partial) in a pass of its own, reuse cut back to whole prompt cells short of that step,
committed tokens replayed one per round. With ``grid`` off the same executor behaves as the commit
before did (plain chunks, any reused prefix), so the two are measured in one process on one
engine, alternating, ``--repeats`` times; in alternated order; each line gives the median and every round.

Cases (greedy, ``ignore_eos``; steps of the engine's batch, 2,048 tokens, as the worker takes them):

* 1 and 8 lanes over 8 short prompts, 64 new tokens each: generated tokens/s, prefill included;
* 1 lane, one ``--long``-token prompt, 8 new tokens: tokens/s and first-token time (cold);
* 8 lanes over 8 ``--long``-token prompts sharing all but their last ~500 tokens (agents on one
  long context), 16 new tokens each: aggregate tokens/s (the shared part is copied, cut to cells);
* a ``--long``-token four-message conversation: first token cold, then warm (the same request
  again), then a follow-up turn (the conversation, its 64-token reply and a short question: the
  grid prefills the reply again, the commit before reused it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from superfluid.proto import Admit, Sampling
from superfluid.worker._executor import Executor
from superfluid.worker._llamacpp import LlamaEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, model_file  # noqa: E402

from tests.test_one_reply import _SENTENCES  # noqa: E402  (the one-reply test's maintenance notes)

STEP = 2048


def _chatml(messages: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages) + "<|im_start|>assistant\n"


def conversation(engine: LlamaEngine, n_tokens: int) -> list[int]:
    """A four-message conversation (system, a long note, an assistant turn, a question) of about
    ``n_tokens`` tokens (ChatML, SmolLM2's template)."""
    entries: list[str] = []
    while True:
        i = len(entries)
        entries.append(f"Entry {i}: {_SENTENCES[i % 12]} {_SENTENCES[(i * 5 + 3) % 12]}")
        toks = engine.tokenize(_chatml([
            ("system", "You are a careful assistant for a water treatment plant. Answer from the notes."),
            ("user", "Here are the maintenance notes for the month.\n\n" + "\n".join(entries)),
            ("assistant", "I have read the notes. What would you like to know about them?"),
            ("user", "What happened to the buffer this month, and which entries say so?"),
        ]), add_special=False, parse_special=True)
        if len(toks) >= n_tokens:
            return toks


class Bench:
    def __init__(self, engine: LlamaEngine) -> None:
        self.engine = engine
        self.tag = 0

    def executor(self, grid: bool, lanes: int) -> Executor:
        self.engine.grid = grid
        for seq in range(self.engine.info.n_seq):
            self.engine.seq_rm(seq, 0, -1)
        return Executor(self.engine, max_lanes=lanes)

    def serve(self, ex: Executor, work: list[list[int]], lanes: int, tokens: int) -> dict[str, Any]:
        """At most ``lanes`` at once; returns tokens/s (prefill included), first-token times, outputs."""
        queue = list(work)
        started: dict[int, float] = {}
        first: dict[int, float] = {}
        out: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        while queue or ex.lanes:
            while queue and len(ex.lanes) < lanes:
                self.tag += 1
                toks = queue.pop(0)
                ex.admit(Admit(lane=self.tag, tokens=toks, n_prompt=len(toks), max_new=tokens, sampling=Sampling(),
                               ignore_eos=True))
                started[self.tag] = time.perf_counter()
                out[self.tag] = []
            res = ex.step(prefill_budget=STEP, max_step_tokens=STEP)
            now = time.perf_counter()
            for row in res.emits:
                first.setdefault(row[0], now - started[row[0]])
                out[row[0]].append(row[1])
        wall = time.perf_counter() - t0
        generated = sum(len(v) for v in out.values())
        return {"tok_s": generated / wall, "wall": wall, "ttft": [first[t] for t in out], "out": list(out.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long", type=int, default=5200, help="tokens of the long prompts (default 5200)")
    parser.add_argument("--cases", default="short,long,agents,conversation")
    args = parser.parse_args()
    args.model = model_file(args.model)
    engine = LlamaEngine(args.model, max_batch=8, max_context=8192, threads=args.threads)
    b = Bench(engine)
    cases = set(args.cases.split(","))
    print(f"in-process executor, commit {commit()}: model {engine.info.name}, {args.threads} threads; "
          f"grid on (this commit's default) vs off (the commit before's executor), median of {args.repeats} "
          "alternated rounds",
          flush=True)
    short = [engine.tokenize(f"Question {i}: explain topic number {i} in detail, please. Answer:",
                             add_special=True, parse_special=False) for i in range(8)]
    conv = conversation(engine, args.long)

    def ab(name: str, run: Any, fmt: Any) -> None:
        got: dict[bool, list[Any]] = {True: [], False: []}
        for i in range(args.repeats):
            # alternated: which side goes first changes every round
            for grid in ((True, False) if i % 2 == 0 else (False, True)):
                got[grid].append(run(grid))
        print(f"{name}: {fmt(got[True])} (grid) vs {fmt(got[False])} (before)", flush=True)

    def med(xs: list[float], unit: str, digits: int = 2) -> str:
        """The median, then every round's value (so a reader sees the spread)."""
        each = ", ".join(f"{x:.{digits}f}" for x in xs)
        return f"{statistics.median(xs):.{digits}f} {unit}" + (f" [{each}]" if len(xs) > 1 else "")

    def rate(rs: list[dict[str, Any]]) -> str:
        return med([r["tok_s"] for r in rs], "tok/s")

    if "short" in cases:
        for lanes in (1, 8):
            ab(f"{lanes} lane(s), 8 short prompts x 64 tokens",
               lambda grid, n=lanes: b.serve(b.executor(grid, n), short, n, 64), rate)
    if "long" in cases:
        ab(f"1 lane, one {len(conv)}-token prompt, 8 tokens",
           lambda grid: b.serve(b.executor(grid, 1), [conv], 1, 8),
           lambda rs: f"{rate(rs)}, first token {med([r['ttft'][0] for r in rs], 's')}")
    if "agents" in cases:
        head = conv[: len(conv) - 500]
        tails = [engine.tokenize(f" Agent {i}: " + " ".join(_SENTENCES[(i + k) % 12] for k in range(30)),
                                 add_special=False, parse_special=False)[:480] for i in range(8)]
        agents = [head + t for t in tails]
        ab(f"8 lanes, 8 prompts of ~{len(agents[0])} tokens sharing {len(head)}, 16 tokens each",
           lambda grid: b.serve(b.executor(grid, 8), agents, 8, 16), rate)
    if "conversation" in cases:
        def turns(grid: bool) -> dict[str, float]:
            ex = b.executor(grid, 1)
            cold = b.serve(ex, [conv], 1, 64)
            warm = b.serve(ex, [conv], 1, 64)
            assert warm["out"] == cold["out"] or not grid, "grid: the warm reply differs from the cold one"
            follow = conv + cold["out"][0] + engine.tokenize(
                "<|im_end|>\n<|im_start|>user\nAnd the pumps?<|im_end|>\n<|im_start|>assistant\n",
                add_special=False, parse_special=True)
            turn = b.serve(ex, [follow], 1, 8)
            return {"cold": cold["ttft"][0], "warm": warm["ttft"][0], "follow": turn["ttft"][0],
                    "same": float(warm["out"] == cold["out"])}

        ab(f"conversation of {len(conv)} tokens, first token",
           turns, lambda rs: (f"cold {med([r['cold'] for r in rs], 's')}, warm {med([r['warm'] for r in rs], 's', 3)}, "
                              f"follow-up {med([r['follow'] for r in rs], 's')}, "
                              f"warm==cold {all(r['same'] for r in rs)}"))
    engine.close()


if __name__ == "__main__":
    main()
