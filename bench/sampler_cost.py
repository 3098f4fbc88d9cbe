"""What one lane's sampler costs per token, in process (no daemon), beside a decode step.

    python bench/sampler_cost.py [--model PATH] [--draws 500] [--lanes 8]

Prints, per draw: the greedy argmax, a sampled draw over the full vocabulary (the API's
defaults: top_k 0, top_p 1, min_p 0), a sampled draw with llama-server's defaults (top_k 40,
top_p 0.95, min_p 0.05), and the per-token rebuild of the seeded ``dist`` stage alone (the
counter-based seed for token ``k`` needs a fresh stage: llama.cpp's dist sampler takes its seed
only at init); then one decode step of ``--lanes`` one-token rows, for scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from superfluid.proto import Sampling
from superfluid.worker._engine import BatchRow
from superfluid.worker._llamacpp import LlamaEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, model_file  # noqa: E402

CASES = {
    "greedy (numpy argmax)": Sampling(),
    "sampled, full vocabulary": Sampling(temperature=0.8, seed=1),
    "sampled, top_k 40 top_p 0.95 min_p 0.05": Sampling(temperature=0.8, seed=1, top_k=40, top_p=0.95, min_p=0.05),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--draws", type=int, default=500)
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    args.model = model_file(args.model)
    eng = LlamaEngine(args.model, max_batch=args.lanes, max_context=512, threads=args.threads)
    try:
        toks = eng.tokenize("Question 1: explain topic number 1 in detail, please. Answer:", add_special=True,
                            parse_special=False)
        out = eng.decode([BatchRow(seq=0, tokens=tuple(toks), pos0=0, want_logits=True)])[0]
        print(f"commit {commit()}; model {eng.info.name}, vocabulary {eng.info.n_vocab}; {args.draws} draws each")
        for name, sampling in CASES.items():
            smp = eng.new_sampler(sampling, [])
            t0 = time.perf_counter()
            for k in range(args.draws):
                smp.sample(out, k)
                smp._drawn = None  # never accepted: each draw samples the same logits afresh
            print(f"  {name}: {(time.perf_counter() - t0) / args.draws * 1e3:.3f} ms per draw")
            if sampling.temperature:
                t0 = time.perf_counter()
                for k in range(args.draws):
                    smp._reseed(k)
                rebuild = (time.perf_counter() - t0) / args.draws * 1e3
                print(f"    of which the dist stage rebuild: {rebuild:.3f} ms")
            smp.close()
        for seq in range(1, args.lanes):
            eng.decode([BatchRow(seq=seq, tokens=tuple(toks), pos0=0, want_logits=False)])
        rows = [BatchRow(seq=s, tokens=(toks[-1],), pos0=len(toks), want_logits=True) for s in range(args.lanes)]
        steps = 5
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.decode(rows)
            for s in range(args.lanes):
                eng.seq_rm(s, len(toks), -1)
        print(f"  one decode step of {args.lanes} one-token rows: {(time.perf_counter() - t0) / steps * 1e3:.2f} ms")
    finally:
        eng.close()


if __name__ == "__main__":
    main()
