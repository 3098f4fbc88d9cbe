"""Aggregate throughput, superfluid vs llama-server on the same llama.cpp build and model.

    python bench/throughput.py [--model PATH] [--llama-server PATH] [--rounds 5] [--tokens 128]

8 distinct prompts, 128-token replies on /v1/completions with ignore_eos, at 1, 2, 4 and 8
concurrent requests; a warm-up round, then the median of --rounds rounds; aggregate tokens/s
(all tokens / wall time of the round) and median TTFT, side by side with the ratio ours/theirs.
Both servers stay up and rounds alternate between them, so drift hits both alike; the ratio
is the median of the per-round ratios (each round of ours against the llama-server round
right after it), which cancels drift slower than a round (this machine's speed wanders by
up to a third over minutes; a ratio of two medians carries that noise).
Also runs the raw engine ceiling (bench/engine_ceiling.py: Executor + LlamaEngine, no server).

    python bench/throughput.py --log-cost 5

prices the session log instead: two daemons, sessions on disk and on tmpfs, 8-concurrent
rounds alternating between them, medians and their ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Server, free_port, median, stream_request, superfluid_argv  # noqa: E402

Rounds = dict[int, dict[str, list[tuple[float, float]]]]
PROMPTS = [f"Question {i}: explain topic number {i} in detail, please. Answer:" for i in range(8)]


async def one_round(url: str, model: str, conc: int, tokens: int) -> tuple[float, float]:
    results: list[dict] = []
    # no keep-alive: llama-server drops idle connections between rounds, and both get the same client
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        limiter = trio.CapacityLimiter(conc)

        async def one(i: int) -> None:
            async with limiter:
                body = {"model": model, "prompt": PROMPTS[i], "max_tokens": tokens, "temperature": 0,
                        "ignore_eos": True, "stream_options": {"include_usage": True}}
                results.append(await stream_request(client, "/v1/completions", body))

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(len(PROMPTS)):
                n.start_soon(one, i)
        wall = trio.current_time() - t0
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"errors: {errors[:2]}")
    # tokens from usage where the server reports it (a chunk may carry several tokens), else chunks
    total = sum((r["usage"] or {}).get("completion_tokens") or r["tokens"] for r in results)
    return total / wall, median([r["ttft"] for r in results])


async def measure(url: str, model: str, rounds: int, tokens: int) -> dict[int, tuple[float, float]]:
    out = {}
    await one_round(url, model, 8, 16)  # warm-up
    for conc in (1, 2, 4, 8):
        runs = [await one_round(url, model, conc, tokens) for _ in range(rounds)]
        out[conc] = (median([r[0] for r in runs]), median([r[1] for r in runs]))
        print(f"  {conc} concurrent: {out[conc][0]:.1f} tok/s, ttft {out[conc][1] * 1000:.0f} ms", flush=True)
    return out


async def measure_alternating(servers: dict[str, Server], rounds: int, tokens: int,
                              ceiling: Any = None) -> tuple[dict[str, dict[int, tuple[float, float]]], Rounds]:
    """Rounds alternate between the servers (and, given ``ceiling(conc) -> tok/s``,
    the in-process engine ceiling: blocking, while the servers idle). Returns
    the medians (name -> conc -> (tok/s, ttft)) and every round (conc -> name -> rounds)."""
    ids = {}
    for name, srv in servers.items():
        srv.wait_ready()
        ids[name] = model_id(srv.url)
        await one_round(srv.url, ids[name], 8, 16)  # warm-up
    names = [*servers, *(["ceiling"] if ceiling else [])]
    out: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in names}
    every: Rounds = {}
    for conc in (1, 2, 4, 8):
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for _ in range(rounds):
            for name, srv in servers.items():
                runs[name].append(await one_round(srv.url, ids[name], conc, tokens))
            if ceiling:
                runs["ceiling"].append((ceiling(conc), 0.0))
        every[conc] = runs
        for name, got in runs.items():
            out[name][conc] = (median([r[0] for r in got]), median([r[1] for r in got]))
        print(f"  {conc} concurrent: " + ", ".join(
            f"{name} {out[name][conc][0]:.1f} tok/s (rounds {' '.join(f'{r[0]:.0f}' for r in runs[name])})"
            for name in names), flush=True)
    return out, every


def log_cost(args: argparse.Namespace) -> None:
    """Both daemons stay up (the idle one costs nothing); rounds alternate so drift hits both alike."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=Path.home()) as disk, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        servers = {}
        for name, where in (("disk", disk), ("tmpfs", shm)):
            port = free_port()
            servers[name] = Server(f"superfluid-{name}", superfluid_argv(
                args.model, port, "--threads", str(args.threads), "--sessions", where), port)
        try:
            rates: dict[str, list[float]] = {name: [] for name in servers}
            for srv in servers.values():
                srv.wait_ready()
                trio.run(one_round, srv.url, model_id(srv.url), 8, 16)  # warm-up
            for _ in range(args.log_cost):
                for name, srv in servers.items():
                    rates[name].append(trio.run(one_round, srv.url, model_id(srv.url), 8, args.tokens)[0])
        finally:
            for srv in servers.values():
                srv.stop()
    med = {name: median(r) for name, r in rates.items()}
    print(f"8 concurrent, {args.tokens}-token replies, median of {args.log_cost} alternating rounds")
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
    p.add_argument("--skip-ceiling", action="store_true")
    p.add_argument("--only", choices=("superfluid", "llama-server"), help="measure one side (no table)")
    p.add_argument("--sessions", default="", help="superfluid's sessions dir (e.g. on tmpfs, to price fsync)")
    p.add_argument("--log-cost", type=int, default=0, metavar="N",
                   help="price the session log: N alternating 8-concurrent rounds each on two daemons, "
                        "sessions on disk (a temp dir) and on tmpfs (/dev/shm)")
    args = p.parse_args()
    if args.log_cost:
        log_cost(args)
        return
    if args.only == "superfluid":
        port = free_port()
        extra = ["--sessions", args.sessions] if args.sessions else []
        ours = Server("superfluid", superfluid_argv(args.model, port, "--threads", str(args.threads), *extra), port)
        try:
            ours.wait_ready()
            trio.run(measure, ours.url, model_id(ours.url), args.rounds, args.tokens)
        finally:
            ours.stop()
        return
    binary = args.llama_server or subprocess.run(
        ["bash", str(ROOT / "bench/build_llama_server.sh")], capture_output=True, text=True, check=True
    ).stdout.strip().splitlines()[-1]
    # both servers stay up (an idle one costs nothing) and rounds alternate between them, so the
    # machine's drift (this one's speed moves 10-20% over minutes) hits both alike
    port = free_port()
    servers = {"superfluid": Server("superfluid", superfluid_argv(
        args.model, port, "--max-batch", "8", "--max-context", "4096", "--threads", str(args.threads)), port)}
    port = free_port()
    servers["llama-server"] = Server("llama-server", [
        binary, "-m", args.model, "-c", "32768", "-np", "8", "-t", str(args.threads), "--host", "127.0.0.1",
        "--port", str(port)], port, env={"LD_LIBRARY_PATH": str(Path(binary).parent)})
    engine = None
    try:
        level = None
        if not args.skip_ceiling:
            from engine_ceiling import Ceiling  # type: ignore[import-not-found]

            engine = Ceiling(args.model, max_lanes=8, threads=args.threads)
            level = partial(engine.level, tokens=args.tokens)
        results, every = trio.run(measure_alternating, servers, args.rounds, args.tokens, level)
    finally:
        for srv in servers.values():
            srv.stop()
        if engine is not None:
            engine.close()
    ceiling = {c: tok_s for c, (tok_s, _ttft) in results.get("ceiling", {}).items()}

    def per_round(c: int, theirs: str) -> list[float]:
        runs = every[c]
        return [o[0] / t[0] for o, t in zip(runs["superfluid"], runs[theirs], strict=True)]

    def paired(c: int, theirs: str) -> float:
        return median(per_round(c, theirs))

    print()
    print(f"model: {Path(args.model).name}, {args.tokens}-token replies, 8 prompts, median of {args.rounds} "
          "alternating rounds; ratio: median of per-round ratios")
    # rounds below 1.00 says how far the median is from noise (one round varies ~6% here)
    print("| concurrent | superfluid tok/s | llama-server tok/s | ratio | rounds below 1.00 | superfluid TTFT ms "
          "| llama-server TTFT ms |" + (" engine ceiling tok/s | ours/ceiling |" if ceiling else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if ceiling else ""))
    for c in (1, 2, 4, 8):
        o, t = results["superfluid"][c], results["llama-server"][c]
        ratios = per_round(c, "llama-server")
        row = (f"| {c} | {o[0]:.1f} | {t[0]:.1f} | {paired(c, 'llama-server'):.2f} | "
               f"{sum(r < 1 for r in ratios)} of {len(ratios)} | {o[1] * 1000:.0f} | {t[1] * 1000:.0f} |")
        if ceiling:
            row += f" {ceiling[c]:.1f} | {paired(c, 'ceiling'):.2f} |"
        print(row)


if __name__ == "__main__":
    main()
