"""Load scenarios: ``agents_interactive``, ``kv_exhaustion``, ``shared_prefix``.

Concurrent requests run as tasks of one trio nursery; every request is
bounded by a read timeout and a whole-exchange limit from the scale.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Awaitable, Callable

import trio

from ._client import Client
from ._conditions import prefix_prefills, result
from ._corpus import document, percentile
from ._process import Context
from ._reply import Reply

__all__ = ["agents_interactive", "burst", "kv_exhaustion", "prefilled_tokens", "shared_prefix"]

CHAT_QUESTION = "What is the capital of France? One word."


async def burst(n: int, one: Callable[[int], Awaitable[Reply]]) -> tuple[list[Reply], float]:
    """Run ``one(i)`` for i in 0..n-1 at once; the replies in order and the wall time."""
    replies: list[Reply | None] = [None] * n

    async def run(i: int) -> None:
        replies[i] = await one(i)

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(run, i)
    out = [r for r in replies if r is not None]
    assert len(out) == n
    return out, round(trio.current_time() - t0, 3)


def _ttfts(replies: list[Reply]) -> list[float]:
    return [r.ttft for r in replies if r.ok and r.ttft is not None]


async def _agents_pass(client: Client, sz: dict[str, Any], seed0: int, *, qos: bool, chat: bool) -> dict[str, Any]:
    chat_reply: list[Reply] = []

    def agent(i: int) -> Awaitable[Reply]:
        messages = [{"role": "system", "content": "You are a code agent."},
                    {"role": "user", "content": document(sz["doc"], seed0 + i) + "\n\nList five risks in these notes."}]
        return client.chat(messages, max_tokens=sz["max_tokens"], qos="background" if qos else None,
                           timeout=sz["request_limit_s"], limit=sz["request_limit_s"])

    async def interactive() -> None:
        await trio.sleep(sz["chat_delay_s"])
        chat_reply.append(await client.chat(CHAT_QUESTION, max_tokens=16, qos="interactive" if qos else None,
                                            timeout=sz["request_limit_s"], limit=sz["request_limit_s"]))

    async with trio.open_nursery() as nursery:
        if chat:
            nursery.start_soon(interactive)
        agents, wall = await burst(sz["agents"], agent)
    ttfts = _ttfts(agents)
    return {
        "qos_headers": qos and client.qos, "chat": chat_reply[0].summary(text=True) if chat_reply else None,
        "agents_failed": sum(1 for r in agents if not r.ok),
        "agent_failures": sorted({f"{r.outcome}: {r.error}"[:200] for r in agents if not r.ok})[:3],
        "agent_ttft_p50_s": percentile(ttfts, 50), "agent_ttft_max_s": max(ttfts, default=None),
        "max_stall_s": round(max((r.max_gap for r in agents), default=0.0), 3), "wall_s": wall,
    }


async def agents_interactive(ctx: Context) -> dict[str, Any]:
    """Every system runs the same plain passes (no QoS headers) and is judged on ``plain``;
    a server that takes QoS headers also runs ``qos``, reported as a feature row beside it."""
    sz = ctx.sizes("agents_interactive")
    async with ctx.launch(lanes=sz["lanes"], ctx=sz["ctx"]) as target:
        client = target.client
        idle = await client.chat(CHAT_QUESTION, max_tokens=16, timeout=120.0, limit=300.0)
        order = [("agents_only", False, False), ("plain", False, True)]
        if client.qos:
            order.append(("qos", True, True))
        passes: dict[str, Any] = {}
        for k, (name, qos, chat) in enumerate(order):
            passes[name] = await _agents_pass(client, sz, 50 * (k + 1), qos=qos, chat=chat)
            ctx.note(f"    pass {name}: chat TTFT "
                     f"{(passes[name]['chat'] or {}).get('ttft_s')} s, wall {passes[name]['wall_s']} s")
    numbers = {"lanes": sz["lanes"], "ctx": sz["ctx"], "agents": sz["agents"], "agent_max_tokens": sz["max_tokens"],
               "chat_delay_s": sz["chat_delay_s"], "idle_chat": idle.summary(), "judged": "plain", "passes": passes}
    plain = passes["plain"]
    headline = (f"plain pass: chat TTFT {(plain['chat'] or {}).get('ttft_s')} s behind {sz['agents']} agents on "
                f"{sz['lanes']} lanes (idle {idle.summary()['ttft_s']} s); agents failed {plain['agents_failed']}; "
                f"max stall {plain['max_stall_s']} s")
    if "qos" in passes:
        headline += f"; with QoS headers: chat TTFT {(passes['qos']['chat'] or {}).get('ttft_s')} s"
    return result("agents_interactive", numbers, headline)


async def kv_exhaustion(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes("kv_exhaustion")
    async with ctx.launch(lanes=sz["lanes"], ctx=sz["ctx"]) as target:
        client = target.client
        preempt0 = await client.metric("superfluid_preemptions_total")

        def one(i: int) -> Awaitable[Reply]:
            messages = [{"role": "system", "content": "Be thorough."},
                        {"role": "user", "content": document(sz["doc"], 300 + i) + "\n\nExplain these notes in detail."}]
            return client.chat(messages, max_tokens=sz["max_tokens"], ignore_eos=True,
                               timeout=sz["request_limit_s"], limit=sz["request_limit_s"])

        replies, wall = await burst(sz["requests"], one)
        fresh = await client.chat("Say OK.", max_tokens=4, timeout=120.0, limit=300.0)
        preempt1 = await client.metric("superfluid_preemptions_total")
        alive = target.server.alive if target.server else None
        cells = await client.metric("superfluid_kv_total_tokens")
        configured = target.server.kv_cells if target.server else None
    outcomes = Counter(r.outcome for r in replies)
    ttfts = _ttfts(replies)
    demand = sum(min((r.prompt_tokens or 0) + sz["max_tokens"], sz["ctx"]) for r in replies)
    numbers = {
        "lanes": sz["lanes"], "ctx": sz["ctx"], "requests": sz["requests"],
        "kv_tokens": int(cells) if cells else configured,
        "kv_tokens_source": "superfluid_kv_total_tokens" if cells else "configured" if configured else None,
        "max_tokens": sz["max_tokens"], "demand_tokens": demand, "outcomes": dict(outcomes),
        "statuses": dict(Counter(str(r.status) for r in replies)), "wall_s": wall,
        "completion_tokens": sum(r.completion_tokens or 0 for r in replies),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99), "fresh": fresh.summary(),
        "readmit_ttft_s": fresh.summary()["ttft_s"], "server_alive": alive,
        "error_samples": sorted({f"{r.outcome}: {r.error}"[:200] for r in replies if r.error_kind})[:3],
        "preemptions": None if preempt0 is None or preempt1 is None else preempt1 - preempt0,
    }
    numbers["demand_ratio"] = round(demand / numbers["kv_tokens"], 2) if numbers["kv_tokens"] else None
    hist = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items()))
    headline = (f"{sz['requests']} requests demanding {demand} tokens, {numbers['demand_ratio']}x the "
                f"{numbers['kv_tokens']} KV cells: {hist} in {wall:.1f} s; "
                f"fresh request {fresh.outcome}")
    return result("kv_exhaustion", numbers, headline)


def prefilled_tokens(hot: list[Reply], before: float | None, after: float | None) -> tuple[int | None, str | None]:
    """Prompt tokens the server prefilled for the burst: its own counter, its per-response
    ``timings.prompt_n`` (llama-server), else prompt − cached per request; and which it was."""
    if before is not None and after is not None:
        return int(after - before), "superfluid_prefill_tokens_total"
    if hot and all(r.ok for r in hot):
        counted = [(r.timings or {}).get("prompt_n") for r in hot]
        if all(isinstance(c, int) for c in counted):
            return sum(counted), "timings.prompt_n"
        if all(r.prompt_tokens is not None and r.cached_tokens is not None for r in hot):
            return sum((r.prompt_tokens or 0) - (r.cached_tokens or 0) for r in hot), "usage: prompt - cached"
    return None, None


async def shared_prefix(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes("shared_prefix")
    n = sz["requests"]

    def question(i: int) -> str:
        return f"Question {i}: in one sentence, what does note 900.{i + 1} say?"

    async with ctx.launch(lanes=sz["lanes"], ctx=sz["ctx"]) as target:
        client = target.client
        system = document(sz["doc"], 900)
        before = await client.metric("superfluid_prefill_tokens_total")

        def shared(i: int) -> Awaitable[Reply]:
            return client.chat([{"role": "system", "content": system}, {"role": "user", "content": question(i)}],
                               max_tokens=sz["max_tokens"], timeout=sz["request_limit_s"], limit=sz["request_limit_s"])

        def cold(i: int) -> Awaitable[Reply]:
            own = f"Batch {i}. " + document(sz["doc"], 1000 + i)
            return client.chat([{"role": "system", "content": own}, {"role": "user", "content": question(i)}],
                               max_tokens=sz["max_tokens"], timeout=sz["request_limit_s"], limit=sz["request_limit_s"])

        hot, hot_wall = await burst(n, shared)
        after = await client.metric("superfluid_prefill_tokens_total")
        chill, cold_wall = await burst(n, cold)
    prompts = sorted(r.prompt_tokens for r in hot if r.prompt_tokens)
    cached = [r.cached_tokens for r in hot if r.ok]
    prefilled, source = prefilled_tokens(hot, before, after)
    numbers: dict[str, Any] = {
        "lanes": sz["lanes"], "ctx": sz["ctx"], "requests": n, "max_tokens": sz["max_tokens"],
        "shared_failed": sum(1 for r in hot if not r.ok), "cold_failed": sum(1 for r in chill if not r.ok),
        "shared_ttft_p50": percentile(_ttfts(hot), 50), "shared_ttft_p99": percentile(_ttfts(hot), 99),
        "shared_wall_s": hot_wall, "cold_ttft_p50": percentile(_ttfts(chill), 50),
        "cold_ttft_p99": percentile(_ttfts(chill), 99), "cold_wall_s": cold_wall,
        "prompt_tokens": prompts[len(prompts) // 2] if prompts else None,
        "prompt_tokens_per_request": [r.prompt_tokens for r in hot],
        "cached_reported": any(c is not None for c in cached), "cached_sum": sum(c or 0 for c in cached),
        "cached_per_request": [r.cached_tokens for r in hot],
        "prefix_tokens": max((c or 0 for c in cached), default=0),
        "prefilled_tokens": prefilled, "prefilled_source": source,
        "failures": sorted({f"{r.outcome}: {r.error}"[:200] for r in hot + chill if not r.ok})[:3],
    }
    numbers["prefix_prefills"] = prefix_prefills(numbers)
    pre = (f"prefix prefilled {numbers['prefix_prefills']} times ({source})"
           if numbers["prefix_prefills"] is not None else "no prefilled-token count")
    headline = (f"{n} requests on a {numbers['prompt_tokens']}-token prompt: {pre}; TTFT p50 shared "
                f"{numbers['shared_ttft_p50']} s vs cold {numbers['cold_ttft_p50']} s")
    return result("shared_prefix", numbers, headline)
