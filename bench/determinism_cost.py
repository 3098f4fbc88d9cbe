"""What deterministic mode costs: the in-process executor over llama.cpp, no daemon.

Usage::

    python bench/determinism_cost.py --model PATH [--lanes 1,8] [--tokens 64] [--repeats 2]

For each lane count it serves 8 distinct prompts (greedy, ``ignore_eos``), at
most N lanes at once, in the default mode and in deterministic mode (flash
attention off, no repacked weights, prefill in fixed grid cells), alternating
the two ``--repeats`` times, and prints aggregate generated tokens per second
(prefill included) and the ratio. A prompt-heavy row (one 1,500-token prompt,
8 new tokens) shows the prefill side.
"""

from __future__ import annotations

import argparse

from _common import model_file  # bench/ is on sys.path when this file runs
from in_process import run_level

from superfluid.worker._llamacpp import LlamaEngine


def run(engine: LlamaEngine, work: list[list[int]], lanes: int, tokens: int, deterministic: bool) -> float:
    return run_level(engine, work, lanes, tokens, deterministic=deterministic)["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--lanes", default="1,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.model = model_file(args.model)
    engines = {det: LlamaEngine(args.model, max_batch=8, max_context=2048, threads=args.threads,
                                deterministic=det) for det in (False, True)}
    eng = engines[False]
    texts = [f"Question {i}: explain topic number {i} in detail, please. Answer:" for i in range(8)]
    work = [eng.tokenize(t, add_special=True, parse_special=False) for t in texts]
    long = [eng.tokenize("The history of clocks. " * 300, add_special=True, parse_special=False)[:1500]]
    cases = [(f"{n} lanes, {args.tokens} tokens", work, int(n), args.tokens) for n in args.lanes.split(",")]
    cases.append(("1 x 1,500-token prompt, 8 tokens", long, 1, 8))
    for name, prompts, lanes, tokens in cases:
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for det in (False, True):
                rates[det].append(run(engines[det], prompts, lanes, tokens, det))
        base, det = max(rates[False]), max(rates[True])
        print(f"{name}: default {base:.1f} tok/s, deterministic {det:.1f} tok/s, ratio {det / base:.3f}", flush=True)


if __name__ == "__main__":
    main()
