"""The in-process executor: the executor over the llama.cpp runtime, no daemon, no HTTP.

Usage::

    python bench/in_process.py --model PATH [--lanes 1,2,4,8] [--tokens 128]
        [--temperature 0.8 --seed S --top-k 40 --top-p 0.95 --min-p 0.05]

For each concurrency N it serves the same 8 distinct prompts (greedy unless
``--temperature``; ``ignore_eos``, ``--tokens`` new tokens each), at most N
lanes at once (a new lane opens as soon as one finishes, like N concurrent
clients), and prints the aggregate generated tokens per second over the wall
time, prefill included. The KV cache is emptied between levels, so no level
profits from the prefix cache of the one before. It is a reference point, not
a ceiling: the daemon's scheduler batches differently and can beat it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from superfluid.proto import Admit, Sampling
from superfluid.worker._executor import Executor
from superfluid.worker._llamacpp import LlamaEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, model_file  # noqa: E402

N_PROMPTS = 8
PREFILL_BUDGET = 512


def prompts(engine: LlamaEngine) -> list[list[int]]:
    texts = [f"Question {i}: explain topic number {i} in detail, please. Answer:" for i in range(N_PROMPTS)]
    return [engine.tokenize(t, add_special=True, parse_special=False) for t in texts]


def sampling_of(fields: dict[str, Any], lane: int) -> Sampling:
    """The API's sampling fields as the executor takes them; ``seed`` is offset per prompt."""
    if not fields.get("temperature"):
        return Sampling()
    return Sampling(temperature=fields["temperature"], seed=fields["seed"] + lane, top_k=fields["top_k"],
                    top_p=fields["top_p"], min_p=fields["min_p"])


def run_level(engine: LlamaEngine, work: list[list[int]], lanes: int, tokens: int,
              sampling: dict[str, Any] | None = None, *, deterministic: bool = False) -> dict[str, Any]:
    for seq in range(engine.info.n_seq):
        engine.seq_rm(seq, 0, -1)
    ex = Executor(engine, max_lanes=lanes, deterministic=deterministic)
    queue = list(enumerate(work))
    generated = 0
    t0 = time.perf_counter()
    while queue or ex.lanes:
        while queue and len(ex.lanes) < lanes:
            tag, toks = queue.pop(0)
            ex.admit(Admit(lane=tag, tokens=toks, n_prompt=len(toks), max_new=tokens,
                           sampling=sampling_of(sampling or {}, tag), ignore_eos=True))
        res = ex.step(prefill_budget=PREFILL_BUDGET)
        if res.faults:
            raise RuntimeError(f"lane faults: {res.faults}")
        generated += sum(1 for row in res.emits if row[1] >= 0)
    wall = time.perf_counter() - t0
    return {"lanes": lanes, "tok_s": generated / wall, "wall_s": wall, "generated": generated,
            "steps": ex.stats["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--lanes", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=1, help="prompt i samples with seed S + i (default 1)")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=0.05)
    args = parser.parse_args()
    args.model = model_file(args.model)
    fields = {"temperature": args.temperature, "seed": args.seed, "top_k": args.top_k, "top_p": args.top_p,
              "min_p": args.min_p}
    levels = [int(x) for x in args.lanes.split(",") if x]
    engine = LlamaEngine(args.model, max_batch=max(levels), max_context=args.max_context, threads=args.threads)
    try:
        work = prompts(engine)
        said = f"temperature {args.temperature}, seed {args.seed}+i" if args.temperature else "greedy"
        print(f"in-process executor, commit {commit()}: model {engine.info.name} ({engine.info.architecture}, kv "
              f"{engine.info.kv_layout}), {N_PROMPTS} prompts x {args.tokens} tokens, {said}, {args.threads} threads",
              flush=True)
        for lanes in levels:
            r = run_level(engine, work, lanes, args.tokens, fields)
            print(f"{r['lanes']:>2} lanes: {r['tok_s']:7.1f} tok/s aggregate "
                  f"({r['generated']} tokens in {r['wall_s']:.1f} s, {r['steps']} steps)", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()


class InProcess:
    """One loaded engine whose levels a script runs between its own rounds (the levels, not a daemon)."""

    def __init__(self, model: str, *, max_lanes: int, threads: int, sampling: dict[str, Any]) -> None:
        self.engine = LlamaEngine(model, max_batch=max_lanes, max_context=4096, threads=threads)
        self.work = prompts(self.engine)
        self.sampling = sampling
        run_level(self.engine, self.work, max_lanes, 16, sampling)  # warm-up

    def level(self, lanes: int, *, tokens: int) -> float:
        return float(run_level(self.engine, self.work, lanes, tokens, self.sampling)["tok_s"])

    def close(self) -> None:
        self.engine.close()
