"""QoS scheduling, superfluid vs llama-server on the same build and model (issue 4).

    python bench/qos.py [--model PATH] [--llama-server PATH] [--parts agents,shared,kv]

(a) agents: eight agents with ~1,800-token prompts (marked ``background`` on
    superfluid), then a chat (``interactive``) two seconds later. Chat TTFT, agent
    completion, the longest stall inside any agent stream.
(b) shared: 16 requests sharing one ~2,400-token system prompt, sent at once, then
    16 with distinct system prompts. Times the shared part was prefilled (from
    cached-token reports where the server gives them), median TTFT shared vs distinct.
(c) kv: 32 concurrent ~3,900-token requests against 8 lanes x 4,096 tokens of KV
    (about 4x the pool), then a fresh request. Outcomes must be ok or typed errors.

Prompt sizes are in SmolLM2 tokens (``document(n)`` gives about 1.4 n of them).

Prints numbers side by side and the pass conditions from the issue.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Server, free_port, median, stream_request, superfluid_argv  # noqa: E402

from superfluid.suite._corpus import document  # noqa: E402

CHAT_Q = "What is the capital of France? One word."


async def chat(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int,
               headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, **extra}
    return await stream_request(client, "/v1/chat/completions", body, headers)


def max_stall(r: dict[str, Any]) -> float:
    """The longest gap between two content chunks (time to the first token excluded)."""
    stamps = list(r.get("stamps", []))
    return max((b - a for a, b in itertools.pairwise(stamps)), default=0.0)


async def part_agents(url: str, model: str, qos: bool) -> dict[str, Any]:
    hdr_agent = {"x-superfluid-qos": "background"} if qos else {}
    hdr_chat = {"x-superfluid-qos": "interactive"} if qos else {}
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=1800) as c:
        agents: list[dict[str, Any]] = []

        async def agent(i: int) -> None:
            msgs = [{"role": "system", "content": "You are a code agent."},
                    {"role": "user", "content": document(1300, 50 + i) + "\nList five risks in these notes."}]
            agents.append(await chat(c, model, msgs, 64, hdr_agent, ignore_eos=True))

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


async def part_shared(url: str, model: str) -> dict[str, Any]:
    shared = document(1720, 900)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=1800) as c:
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

        shared_rs = await burst(lambda i: shared)
        distinct_rs = await burst(lambda i: f"Batch {i}. " + document(1720, 1000 + i))
    prompt = max((r["usage"] or {}).get("prompt_tokens", 0) for r in shared_rs)
    cached = [((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens") for r in shared_rs]
    prefix = max(prompt - 40, 1)
    out["prompt_tokens"] = prompt
    out["cached_per_request"] = sorted(x or 0 for x in cached)
    out["times_prefilled"] = (16 - sum(cached) / prefix) if all(x is not None for x in cached) and prompt else None
    out["shared_ttft_p50_s"] = median([r["ttft"] for r in shared_rs if r["ttft"] is not None])
    out["distinct_ttft_p50_s"] = median([r["ttft"] for r in distinct_rs if r["ttft"] is not None])
    out["ttft_ratio"] = out["shared_ttft_p50_s"] / out["distinct_ttft_p50_s"]
    out["failures"] = sum(1 for r in shared_rs + distinct_rs if r["error"])
    tp = out["times_prefilled"]
    out["pass"] = out["failures"] == 0 and out["ttft_ratio"] <= 0.25 and (tp is None or tp <= 1.2)
    return out


async def part_kv(url: str, model: str) -> dict[str, Any]:
    outcomes: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=1800) as c:
        async def one(i: int) -> None:
            msgs = [{"role": "system", "content": "Be thorough."},
                    {"role": "user", "content": document(2750, 300 + i) + "\nExplain these notes in detail."}]
            try:
                outcomes.append(await chat(c, model, msgs, 150, ignore_eos=True))
            except httpx.HTTPError as exc:  # an untyped failure: reset, truncation
                outcomes.append({"error": f"transport: {exc!r}", "untyped": True, "tokens": 0})

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(32):
                n.start_soon(one, i)
        wall = trio.current_time() - t0
        fresh = await chat(c, model, [{"role": "user", "content": "Say OK."}], 4)
    ok = sum(1 for r in outcomes if not r["error"])
    untyped = sum(1 for r in outcomes if r.get("untyped"))
    return {"ok": ok, "typed_errors": len(outcomes) - ok - untyped, "untyped": untyped, "wall_s": wall,
            "fresh_ok": fresh["error"] is None, "pass": untyped == 0 and fresh["error"] is None}


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def run_system(name: str, server: Server, parts: list[str]) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {}
    try:
        server.wait_ready()
        mid = model_id(server.url)
        for part in parts:
            if part == "agents":
                res[part] = trio.run(part_agents, server.url, mid, name == "superfluid")
            elif part == "shared":
                res[part] = trio.run(part_shared, server.url, mid)
            else:
                res[part] = trio.run(part_kv, server.url, mid)
            print(f"{name} {part}: {res[part]}", flush=True)
    finally:
        server.stop()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--llama-server", default="")
    p.add_argument("--parts", default="agents,shared,kv")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=("superfluid", "llama-server"), help="measure one side (no table)")
    args = p.parse_args()
    parts = [x for x in args.parts.split(",") if x]
    binary = args.llama_server or subprocess.run(
        ["bash", str(ROOT / "bench/build_llama_server.sh")], capture_output=True, text=True, check=True
    ).stdout.strip().splitlines()[-1]
    results = {}
    for part in parts:
        lanes, ctx = 8, 4096
        port = free_port()
        if args.only != "llama-server":
            ours = Server("superfluid", superfluid_argv(args.model, port, "--max-batch", str(lanes), "--max-context",
                                                        str(ctx), "--threads", str(args.threads)), port)
            results.setdefault("superfluid", {}).update(run_system("superfluid", ours, [part]))
        if args.only == "superfluid":
            continue
        port = free_port()
        theirs = Server("llama-server", [binary, "-m", args.model, "-c", str(lanes * ctx), "-np", str(lanes),
                                         "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port)],
                        port, env={"LD_LIBRARY_PATH": str(Path(binary).parent)})
        results.setdefault("llama-server", {}).update(run_system("llama-server", theirs, [part]))
    if args.only:
        return
    print()
    rows = {
        "agents": [("chat TTFT s", "chat_ttft_s"), ("agents failed", "agents_failed"),
                   ("max agent stall s", "agent_max_stall_s"), ("wall s", "wall_s")],
        "shared": [("prompt tokens", "prompt_tokens"), ("times shared part prefilled", "times_prefilled"),
                   ("TTFT p50 shared s", "shared_ttft_p50_s"), ("TTFT p50 distinct s", "distinct_ttft_p50_s"),
                   ("shared/distinct", "ttft_ratio")],
        "kv": [("ok", "ok"), ("typed errors", "typed_errors"), ("untyped failures", "untyped"), ("wall s", "wall_s"),
               ("fresh request ok", "fresh_ok")],
    }
    print("| part | measure | superfluid | llama-server |")
    print("|---|---|---|---|")
    for part in parts:
        for label, key in rows[part]:
            vals = [results[s][part].get(key) for s in ("superfluid", "llama-server")]
            fmt = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in vals]
            print(f"| {part} | {label} | {fmt[0]} | {fmt[1]} |")
        print(f"| {part} | **pass (issue 4 condition)** | {results['superfluid'][part]['pass']} | "
              f"{results['llama-server'][part]['pass']} |")


if __name__ == "__main__":
    main()
