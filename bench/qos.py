"""QoS scheduling, superfluid vs llama-server on the same build and model (issue 4, issue 16).

    python bench/qos.py [--model PATH] [--llama-server PATH] [--parts agents,shared,kv] [--order-seed N]

(a) agents: eight agents with ~1,800-token prompts, then a chat two seconds later. Chat TTFT,
    agent completion, the longest stall inside any agent stream. Four rows, same model, lanes
    (8), prompts and greedy sampling: superfluid with QoS headers (agents ``background``, chat
    ``interactive``), superfluid with no headers at all, llama-server ``-np 8`` (eight agents
    fill its eight slots) and llama-server ``-np 9`` (one spare slot for the chat).
(b) shared: 16 requests sharing one ~2,400-token system prompt, sent at once, then 16 with
    distinct system prompts. Times the shared part was prefilled, counted as the suite's
    ``shared_prefix`` counts it (the server's prefilled tokens: superfluid's
    ``superfluid_prefill_tokens_total``, llama-server's ``timings.prompt_n``; over the longest
    reported cache hit), median TTFT shared vs distinct.
(c) kv: 32 concurrent ~3,900-token requests against 8 lanes x 4,096 context, then a fresh
    request; the demand is printed against the real KV cells. Outcomes must be ok or typed errors.

``--runtime mlx`` runs part (a) on MLX: the MLX directory ``python -m superfluid.models --mlx``
builds (ours dequantizes it to f32 over OpenBLAS on a Linux CPU) against ``mlx_lm.server`` on the
f32 copy ``bench/mlx_vs_server.py`` makes (same numbers, same kernels, OpenBLAS preloaded), with
``--decode-concurrency``/``--prompt-concurrency`` 8 (the agents fill it) and 9 (a spare place for
the chat).

Equal memory: every llama-server gets the KV cells our worker allocates for 8 lanes x 4,096
(``max(4, lanes + 2)`` sequences: 40,960), split over its slots, and ``--cache-ram 0``; ours runs with
``--host-cache-mb 0``. Each part runs its systems in a seeded random order (printed); the
table names the commit. Prompt sizes are in SmolLM2 tokens (``document(n)`` gives about 1.4 n).
"""

from __future__ import annotations

import argparse
import itertools
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ROOT, Server, commit, free_port, kv_cells, llama_server_argv, median,  # noqa: E402
                     round_orders, stream_request, superfluid_argv)

from superfluid.suite._client import metric_sum  # noqa: E402
from superfluid.suite._conditions import prefix_prefills  # noqa: E402
from superfluid.suite._corpus import document  # noqa: E402
from superfluid.suite._load import prefilled_tokens  # noqa: E402
from superfluid.suite._reply import Reply  # noqa: E402

LANES, CTX = 8, 4096
KV_REPLY = 150
SIZE = {"factor": 1.0}  # --size: prompts and replies scaled for a smoke test (counts and lanes stay)


def sized(n: int) -> int:
    return max(8, round(n * SIZE["factor"]))

SETUPS: dict[str, dict[str, Any]] = {  # name -> which server, its slots, whether requests carry QoS headers
    "superfluid + QoS headers": {"kind": "superfluid", "qos": True},
    "superfluid, no headers": {"kind": "superfluid", "qos": False},
    f"llama-server -np {LANES}": {"kind": "llama-server", "slots": LANES},
    f"llama-server -np {LANES + 1}": {"kind": "llama-server", "slots": LANES + 1},
}
MLX_SETUPS: dict[str, dict[str, Any]] = {
    "superfluid + QoS headers": {"kind": "superfluid", "qos": True},
    "superfluid, no headers": {"kind": "superfluid", "qos": False},
    f"mlx_lm.server {LANES}": {"kind": "mlx_lm.server", "slots": LANES},
    f"mlx_lm.server {LANES + 1}": {"kind": "mlx_lm.server", "slots": LANES + 1},
}
PART_SETUPS = {"agents": list(SETUPS), "shared": ["superfluid, no headers", f"llama-server -np {LANES}"],
               "kv": ["superfluid, no headers", f"llama-server -np {LANES}"]}

CHAT_Q = "What is the capital of France? One word."


async def chat(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int,
               headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """One streamed chat (``stream_request``'s result); a transport failure (a reset, a
    truncated reply) is an untyped error in the result, not an exception that ends the run."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, **extra}
    try:
        return await stream_request(client, "/v1/chat/completions", body, headers)
    except httpx.HTTPError as exc:
        return {"error": f"transport: {exc!r}", "untyped": True, "ttft": None, "tokens": 0, "usage": None,
                "timings": None, "stamps": []}


def max_stall(r: dict[str, Any]) -> float:
    """The longest gap between two content chunks (time to the first token excluded)."""
    stamps = list(r.get("stamps", []))
    return max((b - a for a, b in itertools.pairwise(stamps)), default=0.0)


async def part_agents(url: str, model: str, qos: bool) -> dict[str, Any]:
    hdr_agent = {"x-superfluid-qos": "background"} if qos else {}
    hdr_chat = {"x-superfluid-qos": "interactive"} if qos else {}
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=NO_KEEPALIVE) as c:
        agents: list[dict[str, Any]] = []

        async def agent(i: int) -> None:
            msgs = [{"role": "system", "content": "You are a code agent."},
                    {"role": "user", "content": document(sized(1300), 50 + i) + "\nList five risks in these notes."}]
            agents.append(await chat(c, model, msgs, sized(64), hdr_agent, ignore_eos=True))

        async def interactive() -> None:
            await trio.sleep(2.0)
            r = await chat(c, model, [{"role": "user", "content": CHAT_Q}], 16, hdr_chat)
            out["chat_ttft_s"] = r["ttft"]
            out["chat_ok"] = r["error"] is None

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(agent, i)
            n.start_soon(interactive)
        out["wall_s"] = trio.current_time() - t0
    out["agents_failed"] = sum(1 for a in agents if a["error"] or not a["tokens"])
    out["agent_max_stall_s"] = max(max_stall(a) for a in agents)
    out["pass"] = bool(out["chat_ok"] and out["chat_ttft_s"] is not None and out["chat_ttft_s"] <= 1.0
                       and out["agents_failed"] == 0 and out["agent_max_stall_s"] <= 30)
    return out


# a fresh connection per request: llama-server closes idle keep-alive connections, and a request
# sent on one it just closed failed "Server disconnected without sending a response" (2026-12-01)
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


def _reply(r: dict[str, Any]) -> Reply:
    """A bench result as the suite's Reply, so both count prefilled tokens one way."""
    return Reply(stream=True, status=500 if r["error"] else 200, usage=r["usage"], timings=r["timings"])


async def _metric(c: httpx.AsyncClient, name: str) -> float | None:
    r = await c.get("/metrics")
    return metric_sum(r.text, name) if r.status_code == 200 else None


async def part_shared(url: str, model: str) -> dict[str, Any]:
    shared = document(sized(1720), 900)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=NO_KEEPALIVE) as c:
        async def burst(system_of: Any) -> list[dict[str, Any]]:
            rs: list[dict[str, Any]] = []

            async def one(i: int) -> None:
                msgs = [{"role": "system", "content": system_of(i)},
                        {"role": "user", "content": f"Question {i}: in one sentence, what does note 900.{i + 1} say?"}]
                rs.append(await chat(c, model, msgs, 16))

            async with trio.open_nursery() as n:
                for i in range(16):
                    n.start_soon(one, i)
            return rs

        before = await _metric(c, "superfluid_prefill_tokens_total")
        shared_rs = await burst(lambda i: shared)
        after = await _metric(c, "superfluid_prefill_tokens_total")
        distinct_rs = await burst(lambda i: f"Batch {i}. " + document(sized(1720), 1000 + i))
    replies = [_reply(r) for r in shared_rs]
    prefilled, source = prefilled_tokens(replies, before, after)
    counted = {"requests": len(replies), "prompt_tokens_per_request": [r.prompt_tokens for r in replies],
               "prefix_tokens": max((r.cached_tokens or 0 for r in replies), default=0),
               "prefilled_tokens": prefilled}
    out["prompt_tokens"] = max((r.prompt_tokens or 0 for r in replies), default=0)
    out["cached_per_request"] = sorted(r.cached_tokens or 0 for r in replies)
    out["times_prefilled"] = prefix_prefills(counted)
    out["prefilled_source"] = source
    out["shared_ttft_p50_s"] = median([r["ttft"] for r in shared_rs if r["ttft"] is not None])
    out["distinct_ttft_p50_s"] = median([r["ttft"] for r in distinct_rs if r["ttft"] is not None])
    out["ttft_ratio"] = out["shared_ttft_p50_s"] / out["distinct_ttft_p50_s"]
    out["failures"] = sum(1 for r in shared_rs + distinct_rs if r["error"])
    tp = out["times_prefilled"]
    out["pass"] = out["failures"] == 0 and out["ttft_ratio"] <= 0.25 and (tp is None or tp <= 1.2)
    return out


async def part_kv(url: str, model: str) -> dict[str, Any]:
    outcomes: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=NO_KEEPALIVE) as c:
        async def one(i: int) -> None:
            msgs = [{"role": "system", "content": "Be thorough."},
                    {"role": "user", "content": document(sized(2750), 300 + i) + "\nExplain these notes in detail."}]
            outcomes.append(await chat(c, model, msgs, sized(KV_REPLY), ignore_eos=True))

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(32):
                n.start_soon(one, i)
        wall = trio.current_time() - t0
        fresh = await chat(c, model, [{"role": "user", "content": "Say OK."}], 4)
    ok = sum(1 for r in outcomes if not r["error"])
    untyped = sum(1 for r in outcomes if r.get("untyped"))
    prompts = [(r.get("usage") or {}).get("prompt_tokens") for r in outcomes]
    demand = sum(min(p + sized(KV_REPLY), CTX) for p in prompts if p) if all(prompts) else None
    return {"ok": ok, "typed_errors": len(outcomes) - ok - untyped, "untyped": untyped, "wall_s": wall,
            "demand_over_kv_cells": None if demand is None else round(demand / kv_cells(LANES, CTX), 2),
            "fresh_ok": fresh["error"] is None, "pass": untyped == 0 and fresh["error"] is None}


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def run_system(name: str, server: Server, part: str, qos: bool) -> dict[str, Any]:
    try:
        server.wait_ready()
        # mlx_lm.server's /v1/models lists the Hugging Face cache; "default_model" is its --model
        mid = "default_model" if name.startswith("mlx_lm") else model_id(server.url)
        if part == "agents":
            res = trio.run(part_agents, server.url, mid, qos)
        elif part == "shared":
            res = trio.run(part_shared, server.url, mid)
        else:
            res = trio.run(part_kv, server.url, mid)
        print(f"{name} {part}: {res}", flush=True)
    finally:
        server.stop()
    return res


def start(setup: str, args: argparse.Namespace, binary: str) -> Server:
    how = SETUPS[setup]
    port = free_port()
    if how["kind"] == "superfluid":
        return Server("superfluid", superfluid_argv(args.model, port, "--max-batch", str(LANES), "--max-context",
                                                    str(CTX), "--threads", str(args.threads)), port)
    if how["kind"] == "mlx_lm.server":
        import mlx_vs_server

        from superfluid.worker._mlx import _OPENBLAS

        blas = next((b for b in _OPENBLAS if Path(b).exists()), None)
        return Server("mlx_lm.server", mlx_vs_server.mlx_server_argv(mlx_vs_server.f32_dir(args.model), port,
                                                                     how["slots"]),
                      port, env={"LD_PRELOAD": blas} if blas else {})
    return Server("llama-server", llama_server_argv(binary, args.model, port, lanes=LANES, ctx=CTX,
                                                    threads=args.threads, slots=how["slots"]),
                  port, env={"LD_LIBRARY_PATH": str(Path(binary).parent)})


ROWS = {
    "agents": [("chat TTFT s", "chat_ttft_s"), ("agents failed", "agents_failed"),
               ("max agent stall s", "agent_max_stall_s"), ("wall s", "wall_s")],
    "shared": [("prompt tokens", "prompt_tokens"), ("times shared part prefilled", "times_prefilled"),
               ("counted from", "prefilled_source"), ("TTFT p50 shared s", "shared_ttft_p50_s"),
               ("TTFT p50 distinct s", "distinct_ttft_p50_s"), ("shared/distinct", "ttft_ratio")],
    "kv": [("ok", "ok"), ("typed errors", "typed_errors"), ("untyped failures", "untyped"),
           ("demand / KV cells", "demand_over_kv_cells"), ("wall s", "wall_s"), ("fresh request ok", "fresh_ok")],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the SmolLM2 GGUF (llama.cpp) or MLX directory (mlx)")
    p.add_argument("--runtime", choices=("llamacpp", "mlx"), default="llamacpp",
                   help="mlx: part (a) against mlx_lm.server (see the module docstring)")
    p.add_argument("--llama-server", default="")
    p.add_argument("--parts", default=None, help="default: agents,shared,kv (llamacpp), agents (mlx)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--order-seed", type=int, default=None,
                   help="seed of each part's random order of the systems (default: drawn, and printed)")
    p.add_argument("--only", choices=("superfluid", "llama-server", "mlx_lm.server"),
                   help="measure one side (no table)")
    p.add_argument("--size", type=float, default=1.0,
                   help="scale prompt and reply lengths (default 1.0, the published sizes; e.g. 0.02 to smoke-test)")
    args = p.parse_args()
    SIZE["factor"] = args.size
    if args.runtime == "mlx":
        from superfluid.models._mlx_convert import mlx_test_model_path

        args.model = args.model or str(mlx_test_model_path())
        args.parts = args.parts or "agents"
        if args.parts != "agents":
            p.error("--runtime mlx runs the agents part only")
        SETUPS.clear()
        SETUPS.update(MLX_SETUPS)
        PART_SETUPS["agents"] = list(MLX_SETUPS)
        args.llama_server = "unused"
    args.model = args.model or str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    args.parts = args.parts or "agents,shared,kv"
    parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in parts if x not in ROWS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    binary = "" if args.only == "superfluid" else args.llama_server or subprocess.run(
        ["bash", str(ROOT / "bench/build_llama_server.sh")], capture_output=True, text=True, check=True
    ).stdout.strip().splitlines()[-1]
    order_seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    orders: dict[str, list[str]] = {}
    for k, part in enumerate(parts):
        setups = [s for s in PART_SETUPS[part] if args.only in (None, SETUPS[s]["kind"])]
        orders[part] = round_orders(setups, 1, order_seed + k)[0]
        for setup in orders[part]:
            server = start(setup, args, binary)
            results.setdefault(setup, {})[part] = run_system(setup, server, part, SETUPS[setup].get("qos", False))
    if args.only:
        return
    print()
    scaled = "" if args.size == 1.0 else f"; SIZES x {args.size} (a smoke test, not the published setup)"
    if args.runtime == "mlx":
        print(f"commit {commit()}; model {Path(args.model).name} (MLX; mlx_lm.server on its f32 copy); greedy; "
              f"{LANES} lanes x {CTX} context{scaled}")
    else:
        print(f"commit {commit()}; model {Path(args.model).name}; greedy; {LANES} lanes x {CTX} context{scaled}; "
              f"{kv_cells(LANES, CTX)} KV cells for every server (llama-server -c {kv_cells(LANES, CTX)} "
              f"--cache-ram 0); superfluid --host-cache-mb 0")
    print(f"system order (seed {order_seed}): " + "; ".join(f"{part}: {', '.join(o)}" for part, o in orders.items()))
    for part in parts:
        cols = PART_SETUPS[part]
        print()
        print(f"| {part} | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for label, key in ROWS[part]:
            vals = [results[c][part].get(key) for c in cols]
            print(f"| {label} | " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in vals) + " |")
        print("| **pass (issue 4 condition)** | " + " | ".join(str(results[c][part]["pass"]) for c in cols) + " |")


if __name__ == "__main__":
    main()
