"""Aggregate throughput on MLX: superfluid (``--runtime mlx``) vs ``mlx_lm.server`` (same mlx-lm,
same weights, same BLAS).

    python bench/mlx_vs_server.py [--model DIR] [--pairs 4bit,f32] [--rounds 3] [--tokens 128]
        [--lanes 8] [--concurrency 1,2,4,8] [--prompts 8] [--order-seed N]

Two pairs, each compared within itself:

- ``4bit``: both serve the 4-bit directory with MLX's quantized kernels (ours with
  ``SUPERFLUID_MLX_CPU_WEIGHTS=native``): the serving layers compared on the same compute.
- ``f32``: ours as shipped on a Linux CPU (the 4-bit directory, dequantized to f32 at load over
  OpenBLAS) vs ``mlx_lm.server`` on an f32 directory ``mlx_lm convert -d --dtype float32`` makes
  from the same one: the same numbers through the same kernels.

Both sides get the system's OpenBLAS (ours binds it itself; ``mlx_lm.server`` through
``LD_PRELOAD``), ``mlx_lm.server`` ``--decode-concurrency`` and ``--prompt-concurrency`` =
``--lanes``, ours ``--max-batch`` = ``--lanes``. Each round sends ``--prompts`` distinct prompts on
``/v1/completions`` (greedy, ``ignore_eos``, which mlx_lm.server ignores: its tokens are counted
from ``usage``) at each concurrency; within a round the two systems of a pair run in a seeded
random order, and the ratio is the median of per-round ratios (ours / theirs), so drift hits both
alike. Default model: the MLX directory ``python -m superfluid.models --mlx`` builds. Prints one
table naming the commit. Needs a quiet machine for numbers worth publishing; ``--tokens 4
--prompts 2 --concurrency 1,2 --rounds 1`` checks that it runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402
from _common import (ROOT, Server, commit, free_port, median, round_orders, stream_request,  # noqa: E402
                     superfluid_argv)


def mlx_server_argv(model: str, port: int, lanes: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(lanes), "--prompt-concurrency", str(lanes)]


async def one_round(url: str, model: str, conc: int, tokens: int, prompts: list[str]) -> float:
    """Aggregate tokens/s of one round: every prompt once, ``conc`` at a time (tokens from ``usage``
    where the server reports it, else text chunks)."""
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        limiter = trio.CapacityLimiter(conc)

        async def one(prompt: str) -> None:
            async with limiter:
                body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                        "ignore_eos": True, "stream_options": {"include_usage": True}}
                results.append(await stream_request(client, "/v1/completions", body))

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for prompt in prompts:
                n.start_soon(one, prompt)
        wall = trio.current_time() - t0
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"errors: {errors[:2]}")
    return sum((r["usage"] or {}).get("completion_tokens") or r["tokens"] for r in results) / wall


async def run(args: argparse.Namespace, pair: str, servers: dict[str, Server]) -> None:
    ours, theirs = list(servers)
    concs = [int(c) for c in args.concurrency.split(",")]
    prompts = throughput.PROMPTS[: args.prompts]
    ids = {}
    for name, srv in servers.items():
        srv.wait_ready()
        # mlx_lm.server's /v1/models lists the Hugging Face cache; "default_model" is its --model
        ids[name] = "default_model" if name == theirs else throughput.model_id(srv.url)
        await one_round(srv.url, ids[name], max(concs), min(args.tokens, 8), prompts)  # warm-up
    rows = []
    for k, conc in enumerate(concs):
        runs: dict[str, list[float]] = {name: [] for name in servers}
        for order in round_orders(list(servers), args.rounds, args.order_seed + k):
            for name in order:
                runs[name].append(await one_round(servers[name].url, ids[name], conc, args.tokens, prompts))
        ratio = median([a / b for a, b in zip(runs[ours], runs[theirs], strict=True)])
        rows.append((conc, median(runs[ours]), median(runs[theirs]), ratio))
        print(f"  [{pair}] {conc} concurrent: ours {rows[-1][1]:.1f} tok/s, mlx_lm.server {rows[-1][2]:.1f} tok/s, "
              f"ratio {ratio:.2f}x", flush=True)
    blas = args.blas or "the wheel's own"
    print(f"\n{pair}: commit {commit()}, model {args.model}, lanes {args.lanes}, {args.tokens}-token replies, "
          f"{args.prompts} prompts a round, median of {args.rounds} rounds, BLAS {blas}")
    print(f"| concurrent | {ours} tok/s | {theirs} tok/s | ratio |\n|---|---|---|---|")
    for conc, a, b, ratio in rows:
        print(f"| {conc} | {a:.1f} | {b:.1f} | {ratio:.2f}x |", flush=True)


def f32_dir(model: str) -> str:
    """An f32 copy of ``model`` (``mlx_lm convert -d``), cached under ``~/.cache/superfluid``."""
    out = Path.home() / ".cache" / "superfluid" / "mlx-f32" / Path(model).resolve().name
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", model, "--mlx-path", str(out),
                        "-d", "--dtype", "float32"], check=True)
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="MLX model directory (default: the SmolLM2 MLX build)")
    p.add_argument("--pairs", default="4bit,f32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--order-seed", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.model is None:
        from superfluid.models._mlx_convert import mlx_test_model_path

        args.model = str(mlx_test_model_path())
    from superfluid.worker._mlx import _OPENBLAS

    args.blas = next((b for b in _OPENBLAS if os.path.exists(b)), None)
    preload = {"LD_PRELOAD": args.blas} if args.blas else {}
    for pair in args.pairs.split(","):
        if pair not in ("4bit", "f32"):
            raise SystemExit(f"--pairs: unknown pair {pair!r} (4bit, f32)")
        ours_port, theirs_port = free_port(), free_port()
        weights = "native" if pair == "4bit" else "f32"
        theirs_model = args.model if pair == "4bit" else f32_dir(args.model)
        servers = {
            f"superfluid-mlx ({pair})": Server(
                f"superfluid-mlx-{pair}", superfluid_argv(args.model, ours_port, "--runtime", "mlx",
                                                          "--max-batch", str(args.lanes)),
                ours_port, env={"PYTHONPATH": str(ROOT), "SUPERFLUID_MLX_CPU_WEIGHTS": weights}),
            f"mlx_lm.server ({pair})": Server(f"mlx_lm.server-{pair}",
                                              mlx_server_argv(theirs_model, theirs_port, args.lanes),
                                              theirs_port, env=preload),
        }
        try:
            trio.run(run, args, pair, servers)
        finally:
            for srv in servers.values():
                srv.stop()


if __name__ == "__main__":
    main()
