"""Which prefill chunk size and batch shape is fastest at long context, on the engine alone.

    python bench/chunk_shape.py [--model PATH] [--length 12000] [--chunks 64,128,256,512,1024,2048]
        [--lanes 4] [--threads 2]

No daemon: a ``LlamaEngine`` sized like the daemon's (``--lanes`` lanes of ``--length`` + 1,024
cells) prefills one ``--length``-token prompt in chunks of each size, and reports tokens/s per
position range (attention grows with the position, so a rate is only comparable within a range).
Then ``--lanes`` prompts of 1,024 tokens prefilled one lane at a time in 512-token chunks against
all lanes together in equal chunks of 512/lanes (the same tokens per step), and the decode rate of
one lane at the end of the long prompt. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, model_file  # noqa: E402

from superfluid.worker._engine import BatchRow  # noqa: E402
from superfluid.worker._llamacpp import LlamaEngine  # noqa: E402


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def prefill(engine: LlamaEngine, seq: int, tokens: list[int], chunk: int, ranges: list[int]) -> list[float]:
    """Seconds spent per position range (``ranges`` are the range ends)."""
    spent = [0.0] * len(ranges)
    pos = 0
    while pos < len(tokens):
        take = tokens[pos:pos + chunk]
        t0 = time.perf_counter()
        engine.decode([BatchRow(seq=seq, tokens=tuple(take), pos0=pos, want_logits=False)])
        dt = time.perf_counter() - t0
        # charge the chunk to the range its middle falls in
        mid = pos + len(take) // 2
        spent[next(i for i, end in enumerate(ranges) if mid < end)] += dt
        pos += len(take)
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--length", type=int, default=12000)
    p.add_argument("--chunks", default="64,128,256,512,1024,2048")
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    args.model = model_file(args.model)
    ctx = -(-(args.length + 1024) // 1024) * 1024
    engine = LlamaEngine(args.model, max_batch=args.lanes, max_context=ctx, threads=args.threads)
    rng = random.Random(1)
    vocab = engine.info.n_vocab
    step = 2048 if args.length > 4096 else 1024
    ranges = list(range(step, args.length, step)) + [args.length]
    print(f"commit {commit()}; {Path(args.model).name}; {args.threads} threads; {args.lanes} lanes x {ctx} cells "
          f"(layout {engine.info.kv_layout}, flash attention auto)")
    print("| chunk | " + " | ".join(f"{a}-{b}" for a, b in zip([0, *ranges], ranges, strict=False)) + " | whole |")
    print("|---|" + "---|" * (len(ranges) + 1))
    toks = prompt(rng, args.length, vocab)
    for chunk in [int(c) for c in args.chunks.split(",")]:
        engine.seq_rm(0, 0, -1)
        spent = prefill(engine, 0, toks, chunk, ranges)
        widths = [b - a for a, b in zip([0, *ranges], ranges, strict=False)]
        cells = [f"{w / s:.0f}" if s else "-" for w, s in zip(widths, spent, strict=True)]
        print(f"| {chunk} | " + " | ".join(cells) + f" | {args.length / sum(spent):.0f} |", flush=True)
    # decode of one lane at the end of the long prompt
    last = toks[-1]
    t0 = time.perf_counter()
    n = 32
    for i in range(n):
        engine.decode([BatchRow(seq=0, tokens=(last,), pos0=args.length + i, want_logits=True)])
    print(f"\ndecode, one lane at position {args.length}: {n / (time.perf_counter() - t0):.1f} tok/s")
    # several lanes' prompts: one at a time vs together
    n_lane = 1024
    lanes = [prompt(rng, n_lane, vocab) for _ in range(args.lanes)]
    for s in range(args.lanes):
        engine.seq_rm(s, 0, -1)
    t0 = time.perf_counter()
    for s, toks_s in enumerate(lanes):
        for pos in range(0, n_lane, 512):
            engine.decode([BatchRow(seq=s, tokens=tuple(toks_s[pos:pos + 512]), pos0=pos, want_logits=False)])
    serial = time.perf_counter() - t0
    for s in range(args.lanes):
        engine.seq_rm(s, 0, -1)
    part = 512 // args.lanes
    t0 = time.perf_counter()
    for pos in range(0, n_lane, part):
        engine.decode([BatchRow(seq=s, tokens=tuple(lanes[s][pos:pos + part]), pos0=pos, want_logits=False)
                       for s in range(args.lanes)])
    together = time.perf_counter() - t0
    total = n_lane * args.lanes
    print(f"{args.lanes} prompts of {n_lane}: one lane at a time {total / serial:.0f} tok/s, "
          f"all together ({args.lanes} x {part} per step) {total / together:.0f} tok/s")
    engine.close()


if __name__ == "__main__":
    main()
