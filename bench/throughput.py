"""Aggregate throughput, superfluid vs llama-server on the same llama.cpp build and model.

    python bench/throughput.py [--model PATH] [--llama-server PATH] [--rounds 5] [--tokens 128]
        [--temperature 0.8 --seed S] [--order-seed N] [--concurrency 1,8] [--baseline TREE]

8 distinct prompts, 128-token replies on /v1/completions with ignore_eos, at 1, 2, 4 and 8
concurrent requests; a warm-up round, then the median of --rounds rounds; aggregate tokens/s
(all tokens / wall time of the round) and median TTFT, side by side with the ratio ours/theirs.
Greedy by default; ``--temperature T --seed S`` samples, with the same sampler settings sent to
both servers (``--top-k``, ``--top-p``, ``--min-p``; llama-server's defaults) and seed ``S + i``
for prompt ``i``. Both servers stay up; within each round the order of the systems is drawn
at random from ``--order-seed`` (printed), so neither side always runs first and drift hits both
alike; the ratio is the median of the per-round ratios (ours against llama-server's round of the
same index), which cancels drift slower than a round.

``--baseline TREE`` adds a third system: our daemon run from another source tree (a
``git worktree`` of an earlier commit, its working directory and first on ``PYTHONPATH``, its
worker too; the log says which files each daemon imported) with the same
flags, so a change is judged by same-run ratios against llama-server and against itself
before the change, not against a number from another day.

Equal memory: llama-server gets ``-c`` = the KV cells our worker allocates for 8 lanes x 4,096
(``max(4, lanes + 2)`` sequences) and ``--cache-ram 0``, and ours runs with ``--host-cache-mb 0``
(``--host-cache-mb`` to price it; the table says which). Also runs the in-process executor (bench/in_process.py:
Executor + LlamaEngine, no daemon, no HTTP) with the same sampling. Every table names the commit
it ran on.

    python bench/throughput.py --log-cost 5

prices the session log instead: two daemons, sessions on disk and on tmpfs, 8-concurrent
rounds in a seeded random order per round, medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ROOT, Server, commit, completions_burst, free_port, kv_cells, llama_server_argv, median,  # noqa: E402
                     model_file, round_orders, superfluid_argv)

Rounds = dict[int, dict[str, list[tuple[float, float]]]]
PROMPTS = [f"Question {i}: explain topic number {i} in detail, please. Answer:" for i in range(8)]
LANES, CTX = 8, 4096
EXECUTOR = "in-process executor"
BASE = "superfluid-base"
GREEDY: dict[str, Any] = {"temperature": 0}


def sampling_body(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields both servers get (``seed`` is offset per prompt)."""
    if args.temperature <= 0:
        return dict(GREEDY)
    return {"temperature": args.temperature, "seed": args.seed, "top_k": args.top_k, "top_p": args.top_p,
            "min_p": args.min_p}


async def one_round(url: str, model: str, conc: int, tokens: int,
                    sampling: dict[str, Any] | None = None) -> tuple[float, float]:
    results, wall = await completions_burst(url, model, PROMPTS, tokens, sampling or GREEDY, concurrency=conc)
    # tokens from usage where the server reports it (a chunk may carry several tokens), else chunks
    total = sum((r["usage"] or {}).get("completion_tokens") or r["tokens"] for r in results)
    return total / wall, median([r["ttft"] for r in results])


async def measure(url: str, model: str, rounds: int, tokens: int,
                  sampling: dict[str, Any]) -> dict[int, tuple[float, float]]:
    out = {}
    await one_round(url, model, 8, 16, sampling)  # warm-up
    for conc in (1, 2, 4, 8):
        runs = [await one_round(url, model, conc, tokens, sampling) for _ in range(rounds)]
        out[conc] = (median([r[0] for r in runs]), median([r[1] for r in runs]))
        print(f"  {conc} concurrent: {out[conc][0]:.1f} tok/s, ttft {out[conc][1] * 1000:.0f} ms", flush=True)
    return out


async def measure_rounds(servers: dict[str, Server], rounds: int, tokens: int, sampling: dict[str, Any],
                         order_seed: int, executor: Any = None, concs: tuple[int, ...] = (1, 2, 4, 8),
                         ) -> tuple[dict[str, dict[int, tuple[float, float]]], Rounds, dict[int, list[list[str]]]]:
    """Rounds run every system once each, in a seeded random order per round (and, given
    ``executor(conc) -> tok/s``, the in-process executor: blocking, while the servers idle).
    Returns the medians (name -> conc -> (tok/s, ttft)), every round (conc -> name -> rounds)
    and the order each round ran in (conc -> rounds -> names)."""
    ids = {}
    for name, srv in servers.items():
        srv.wait_ready()
        ids[name] = model_id(srv.url)
        await one_round(srv.url, ids[name], 8, 16, sampling)  # warm-up
    names = [*servers, *([EXECUTOR] if executor else [])]
    out: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in names}
    every: Rounds = {}
    orders: dict[int, list[list[str]]] = {}
    for k, conc in enumerate(concs):
        orders[conc] = round_orders(names, rounds, order_seed + k)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for order in orders[conc]:
            for name in order:
                if name == EXECUTOR:
                    runs[name].append((executor(conc), 0.0))
                else:
                    runs[name].append(await one_round(servers[name].url, ids[name], conc, tokens, sampling))
        every[conc] = runs
        for name, got in runs.items():
            out[name][conc] = (median([r[0] for r in got]), median([r[1] for r in got]))
        print(f"  {conc} concurrent: " + ", ".join(
            f"{name} {out[name][conc][0]:.1f} tok/s (rounds {' '.join(f'{r[0]:.0f}' for r in runs[name])})"
            for name in names), flush=True)
    return out, every, orders


def log_cost(args: argparse.Namespace) -> None:
    """Both daemons stay up (the idle one costs nothing); rounds alternate so drift hits both alike."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=Path.home()) as disk, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        servers = {}
        for name, where in (("disk", disk), ("tmpfs", shm)):
            port = free_port()
            servers[name] = Server(f"superfluid-{name}", superfluid_argv(
                args.model, port, "--threads", str(args.threads), "--sessions", where,
                host_cache_mb=args.host_cache_mb), port)
        try:
            rates: dict[str, list[float]] = {name: [] for name in servers}
            for srv in servers.values():
                srv.wait_ready()
                trio.run(one_round, srv.url, model_id(srv.url), 8, 16)  # warm-up
            order_seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
            orders = round_orders(list(servers), args.log_cost, order_seed)
            for order in orders:
                for name in order:
                    srv = servers[name]
                    rates[name].append(trio.run(one_round, srv.url, model_id(srv.url), 8, args.tokens)[0])
        finally:
            for srv in servers.values():
                srv.stop()
    med = {name: median(r) for name, r in rates.items()}
    print(f"commit {commit()}; 8 concurrent, {args.tokens}-token replies, median of {args.log_cost} rounds; "
          f"round order (seed {order_seed}): " + " | ".join(",".join(o) for o in orders))
    print("| log on disk tok/s | log on tmpfs tok/s | disk/tmpfs |")
    print("|---|---|---|")
    print(f"| {med['disk']:.1f} | {med['tmpfs']:.1f} | {med['disk'] / med['tmpfs']:.3f} |")
    print("rounds:", {name: [round(x, 1) for x in r] for name, r in rates.items()})


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--llama-server", default="")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=1, help="sampling seed S (prompt i gets S + i; default 1)")
    p.add_argument("--top-k", type=int, default=40, help="sampled runs, both servers (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="sampled runs, both servers (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="sampled runs, both servers (default 0.05)")
    p.add_argument("--order-seed", type=int, default=None,
                   help="seed of the per-round random order of the systems (default: drawn, and printed)")
    p.add_argument("--host-cache-mb", type=int, default=0,
                   help="superfluid's host cache for evicted prefixes (default 0: llama-server has none)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)")
    p.add_argument("--baseline", default="", metavar="TREE",
                   help="also run our daemon from this source tree (e.g. a git worktree of an earlier commit)")
    p.add_argument("--skip-executor", action="store_true", help="do not run the in-process executor")
    p.add_argument("--only", choices=("superfluid", "llama-server"), help="measure one side (no table)")
    p.add_argument("--sessions", default="", help="superfluid's sessions dir (e.g. on tmpfs, to price fsync)")
    p.add_argument("--log-cost", type=int, default=0, metavar="N",
                   help="price the session log: N alternating 8-concurrent rounds each on two daemons, "
                        "sessions on disk (a temp dir) and on tmpfs (/dev/shm)")
    args = p.parse_args()
    args.model = model_file(args.model)
    if args.log_cost:
        log_cost(args)
        return
    sampling = sampling_body(args)
    concs = tuple(int(c) for c in args.concurrency.split(","))
    if args.only == "superfluid":
        port = free_port()
        extra = ["--sessions", args.sessions] if args.sessions else []
        ours = Server("superfluid", superfluid_argv(args.model, port, "--threads", str(args.threads), *extra,
                                                    host_cache_mb=args.host_cache_mb), port)
        try:
            ours.wait_ready()
            trio.run(measure, ours.url, model_id(ours.url), args.rounds, args.tokens, sampling)
        finally:
            ours.stop()
        return
    binary = args.llama_server or subprocess.run(
        ["bash", str(ROOT / "bench/build_llama_server.sh")], capture_output=True, text=True, check=True
    ).stdout.strip().splitlines()[-1]
    order_seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
    port = free_port()
    servers = {"superfluid": Server("superfluid", superfluid_argv(
        args.model, port, "--max-batch", str(LANES), "--max-context", str(CTX), "--threads", str(args.threads),
        host_cache_mb=args.host_cache_mb), port)}
    if args.baseline:
        tree = str(Path(args.baseline).resolve())
        port = free_port()
        servers[BASE] = Server("superfluid-base", superfluid_argv(
            args.model, port, "--max-batch", str(LANES), "--max-context", str(CTX), "--threads", str(args.threads),
            host_cache_mb=args.host_cache_mb), port, env={"PYTHONPATH": tree}, cwd=tree)
        # ``python -m`` puts the working directory first on sys.path: the tree must be both
        where = subprocess.run([sys.executable, "-c", "import superfluid; print(superfluid.__file__)"], cwd=tree,
                               env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True).stdout.strip()
        print(f"{BASE} imports {where}", flush=True)
    port = free_port()
    servers["llama-server"] = Server("llama-server", llama_server_argv(
        binary, args.model, port, lanes=LANES, ctx=CTX, threads=args.threads), port,
        env={"LD_LIBRARY_PATH": str(Path(binary).parent)})
    engine = None
    try:
        level = None
        if not args.skip_executor:
            from in_process import InProcess  # type: ignore[import-not-found]

            engine = InProcess(args.model, max_lanes=LANES, threads=args.threads, sampling=sampling)
            level = partial(engine.level, tokens=args.tokens)
        results, every, orders = trio.run(measure_rounds, servers, args.rounds, args.tokens, sampling, order_seed,
                                          level, concs)
    finally:
        for srv in servers.values():
            srv.stop()
        if engine is not None:
            engine.close()
    executor = {c: tok_s for c, (tok_s, _ttft) in results.get(EXECUTOR, {}).items()}

    def per_round(c: int, theirs: str, ours: str = "superfluid") -> list[float]:
        runs = every[c]
        return [o[0] / t[0] for o, t in zip(runs[ours], runs[theirs], strict=True)]

    def paired(c: int, theirs: str, ours: str = "superfluid") -> float:
        return median(per_round(c, theirs, ours))

    said = ("greedy" if not args.temperature else
            f"sampled: temperature {args.temperature}, seed {args.seed}+i, top_k {args.top_k}, top_p {args.top_p}, "
            f"min_p {args.min_p} (same on both)")
    print()
    print(f"commit {commit()}; model {Path(args.model).name}; {said}; {args.tokens}-token replies, 8 prompts, "
          f"median of {args.rounds} rounds; ratio: median of per-round ratios")
    print(f"memory: {kv_cells(LANES, CTX)} KV cells each (ours --max-batch {LANES} --max-context {CTX}, "
          f"llama-server -c {kv_cells(LANES, CTX)} -np {LANES} --cache-ram 0); ours --host-cache-mb {args.host_cache_mb}")
    print(f"round order (seed {order_seed}): " + "; ".join(
        f"{c} concurrent: " + " | ".join(",".join(o) for o in orders[c]) for c in orders))
    # rounds below 1.00 says how far the median is from noise (one round varies ~6% here)
    print("| concurrent | superfluid tok/s | llama-server tok/s | ratio | rounds below 1.00 | superfluid TTFT ms "
          "| llama-server TTFT ms |" + (f" {EXECUTOR} tok/s | ours/executor |" if executor else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if executor else ""))
    for c in concs:
        o, t = results["superfluid"][c], results["llama-server"][c]
        ratios = per_round(c, "llama-server")
        row = (f"| {c} | {o[0]:.1f} | {t[0]:.1f} | {paired(c, 'llama-server'):.2f} | "
               f"{sum(r < 1 for r in ratios)} of {len(ratios)} | {o[1] * 1000:.0f} | {t[1] * 1000:.0f} |")
        if executor:
            row += f" {executor[c]:.1f} | {paired(c, EXECUTOR):.2f} |"
        print(row)
    if BASE in results:
        print(f"\nbaseline: {BASE} = our daemon from {args.baseline} (commit {commit(Path(args.baseline))})")
        print(f"| concurrent | superfluid tok/s | {BASE} tok/s | ours/llama-server | base/llama-server "
              "| ours/base | rounds ours < base |")
        print("|---|---|---|---|---|---|---|")
        for c in concs:
            mine = per_round(c, BASE)
            print(f"| {c} | {results['superfluid'][c][0]:.1f} | {results[BASE][c][0]:.1f} | "
                  f"{paired(c, 'llama-server'):.3f} | {paired(c, 'llama-server', BASE):.3f} | {median(mine):.3f} | "
                  f"{sum(r < 1 for r in mine)} of {len(mine)} |")


if __name__ == "__main__":
    main()
