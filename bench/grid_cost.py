"""What the default mode's grid costs (issue 51): the in-process executor over llama.cpp, no daemon.

Usage::

    python bench/grid_cost.py [--model PATH] [--threads 2] [--repeats 3] [--long 5200] [--cases ...]
    python bench/grid_cost.py --render LOG [--doc docs/benchmarks.md]

Writes a JSON-lines log (a header, then one record per case, side and round) under
``bench-results/<commit>/`` and prints the table rendered from it; ``--render`` renders a log
again, into ``--doc`` between its markers. Refuses a busy machine (load above 0.5) unless
``--allow-busy``.

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
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from superfluid.proto import Admit, Sampling
from superfluid.worker._executor import Executor
from superfluid.worker._llamacpp import LlamaEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, commit, log_header, median, model_file, shown, write_doc  # noqa: E402

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


MARK_BEGIN = "<!-- bench/grid_cost.py {model}: begin (generated by `python bench/grid_cost.py --render LOG --doc PATH`) -->"
MARK_END = "<!-- bench/grid_cost.py {model}: end -->"
MAX_LOAD = 0.5
# what each case measures: (key, label, unit, higher is better)
MEASURES = {
    "tok_s": ("generated tokens/s, prefill included", "tok/s", True),
    "ttft": ("first token", "s", False),
    "cold": ("first token, cold", "s", False),
    "warm": ("first token, warm (the same request again)", "s", False),
    "follow": ("first token, follow-up turn", "s", False),
}


def render(path: Path) -> tuple[str, str]:
    """The docs section for one log (a pure function of it), and the model it measured (its key)."""
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    head = recs[0]
    a = head["args"]
    model = Path(a["model"]).name
    rounds = [r for r in recs if r["kind"] == "round"]
    cases: dict[str, dict[bool, list[dict[str, Any]]]] = {}
    for r in rounds:
        cases.setdefault(r["case"], {True: [], False: []})[r["grid"]].append(r["values"])
    n = max((len(v[True]) for v in cases.values()), default=0)
    out = [f"## One reply whatever the cache held: the grid's cost, {model} (`python bench/grid_cost.py`): issue #51\n",
           f"At `{head['commit']}`, {head['started']}, on {head['cpu']} ({path.name}), 1-minute load average "
           f"{head['loadavg']:.2f} at the start and {recs[-1].get('loadavg', float('nan')):.2f} at the end. "
           f"Generated by `python bench/grid_cost.py --render {shown(path)}` from that log.\n",
           "The in-process executor over llama.cpp (no daemon, no HTTP), one engine, "
           f"`--threads {a['threads']}`, greedy, `ignore_eos`. *grid*: this commit's default mode over one KV "
           "stream per sequence (prompts prefilled in whole 64-position cells on the absolute grid, the last "
           "step alone, reuse cut to whole cells, a finished prompt's tail kept); *before*: the same executor "
           "with `grid` off (plain chunks, any reused prefix), as the commit before the grid. "
           f"{n} round{'s' if n != 1 else ''}, alternated (grid first in even rounds, before first in odd ones); "
           "medians, and every round's value in the last two columns. Short: 8 prompts of ~17 tokens, 64 tokens each; long: one "
           f"~{a['long']:,}-token prompt, 8 tokens; agents: 8 prompts of ~{a['long']:,} tokens sharing all but ~500, "
           "16 tokens each, 8 lanes; conversation: a four-message conversation, 64 tokens, sent cold, then again "
           "(warm), then its follow-up turn (its reply and a question).\n",
           "| case | measure | grid | before | grid / before | grid rounds | before rounds |",
           "|---|---|---|---|---|---|---|"]
    for case, sides in cases.items():
        keys = [k for k in MEASURES if sides[True] and k in sides[True][0]]
        for key in keys:
            label, unit, _higher = MEASURES[key]
            g = [v[key] for v in sides[True]]
            b = [v[key] for v in sides[False]]
            digits = 3 if unit == "s" and median(g) < 1 else 2
            out.append(f"| {case} | {label} ({unit}) | {median(g):.{digits}f} | {median(b):.{digits}f} | "
                       f"{median(g) / median(b):.2f} | {', '.join(f'{x:.{digits}f}' for x in g)} | "
                       f"{', '.join(f'{x:.{digits}f}' for x in b)} |")
        if sides[True] and "same" in sides[True][0]:
            same = [v["same"] for v in sides[True]]
            out.append(f"\nThe warm reply equals the cold one with the grid in {sum(1 for x in same if x)} of "
                       f"{len(same)} rounds.")
    return "\n".join(out) + "\n", model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long", type=int, default=5200, help="tokens of the long prompts (default 5200)")
    parser.add_argument("--cases", default="short,long,agents,conversation")
    parser.add_argument("--out", type=Path, help="the JSON-lines log (default bench-results/<commit>/grid_cost_<UTC>.jsonl)")
    parser.add_argument("--allow-busy", action="store_true")
    parser.add_argument("--render", type=Path, metavar="LOG")
    parser.add_argument("--doc", type=Path, metavar="PATH")
    args = parser.parse_args()
    if args.render:
        section, model = render(args.render)
        if args.doc:
            write_doc(args.doc, section, MARK_BEGIN.format(model=model), MARK_END.format(model=model))
        else:
            print(section, end="")
        return 0
    load = os.getloadavg()[0]
    if load > MAX_LOAD and not args.allow_busy:
        parser.error(f"the machine is busy (1-minute load average {load:.2f}); --allow-busy runs anyway")
    args.model = model_file(args.model)
    rev = commit()
    path = args.out or ROOT / "bench-results" / rev / f"grid_cost_{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = LlamaEngine(args.model, max_batch=8, max_context=8192, threads=args.threads)
    b = Bench(engine)
    cases = set(args.cases.split(","))
    short = [engine.tokenize(f"Question {i}: explain topic number {i} in detail, please. Answer:",
                             add_special=True, parse_special=False) for i in range(8)]
    conv = conversation(engine, args.long)
    log = open(path, "w")  # noqa: SIM115 - closed below

    def record(rec: dict[str, Any]) -> None:
        log.write(json.dumps(rec) + "\n")
        log.flush()

    record(log_header(rev, args, load))

    def ab(case: str, run: Any, keep: tuple[str, ...]) -> None:
        for i in range(args.repeats):
            # alternated: which side goes first changes every round
            for grid in ((True, False) if i % 2 == 0 else (False, True)):
                got = run(grid)
                values = {k: (got[k][0] if isinstance(got[k], list) else got[k]) for k in keep}
                record({"kind": "round", "case": case, "grid": grid, "round": i, "values": values})
                print(f"{case} round {i} {'grid' if grid else 'before'}: {values}", file=sys.stderr, flush=True)

    try:
        if "short" in cases:
            for lanes in (1, 8):
                ab(f"short, {lanes} lane{'s' if lanes > 1 else ''}",
                   lambda grid, n=lanes: b.serve(b.executor(grid, n), short, n, 64), ("tok_s",))
        if "long" in cases:
            ab(f"long ({len(conv)} tokens), 1 lane", lambda grid: b.serve(b.executor(grid, 1), [conv], 1, 8),
               ("tok_s", "ttft"))
        if "agents" in cases:
            head = conv[: len(conv) - 500]
            tails = [engine.tokenize(f" Agent {i}: " + " ".join(_SENTENCES[(i + k) % 12] for k in range(30)),
                                     add_special=False, parse_special=False)[:480] for i in range(8)]
            agents = [head + t for t in tails]
            ab(f"agents ({len(agents[0])} tokens, {len(head)} shared), 8 lanes",
               lambda grid: b.serve(b.executor(grid, 8), agents, 8, 16), ("tok_s",))
        if "conversation" in cases:
            def turns(grid: bool) -> dict[str, Any]:
                ex = b.executor(grid, 1)
                cold = b.serve(ex, [conv], 1, 64)
                warm = b.serve(ex, [conv], 1, 64)
                follow = conv + cold["out"][0] + engine.tokenize(
                    "<|im_end|>\n<|im_start|>user\nAnd the pumps?<|im_end|>\n<|im_start|>assistant\n",
                    add_special=False, parse_special=True)
                turn = b.serve(ex, [follow], 1, 8)
                return {"cold": cold["ttft"][0], "warm": warm["ttft"][0], "follow": turn["ttft"][0],
                        "same": warm["out"] == cold["out"]}

            ab(f"conversation ({len(conv)} tokens), 1 lane", turns, ("cold", "warm", "follow", "same"))
        record({"kind": "end", "loadavg": os.getloadavg()[0]})
    finally:
        log.close()
        engine.close()
    print(f"log: {path}", file=sys.stderr)
    print(render(path)[0], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
