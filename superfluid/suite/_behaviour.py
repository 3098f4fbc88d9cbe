"""Client-behaviour scenarios: ``tool_session`` and ``client_disconnect``.

``tool_session`` drives one long tool-calling conversation turn by turn;
``client_disconnect`` drops requests mid-generation by closing the socket
and watches how fast the server lets go of the work.
"""

from __future__ import annotations

import json
import random
import string
from collections import Counter
from typing import Any, Awaitable

import trio

from ._client import Client
from ._conditions import result
from ._corpus import QUESTIONS, percentile
from ._load import burst
from ._process import Context
from ._reply import Reply

__all__ = ["client_disconnect", "tool_session"]

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_code",
        "description": "Return the current access code for a named account. Codes change on every call.",
        "parameters": {
            "type": "object",
            "properties": {"account": {"type": "string", "description": "the account name, e.g. acct-0042"}},
            "required": ["account"],
        },
    },
}
TOOL_SYSTEM = ("You are an account assistant. Look up access codes with the lookup_code tool every time; "
               "codes change on every call. Answer in one short sentence.")
LEAK_MARKERS = ("<tool_call>", '"name": "lookup_code"', '"name":"lookup_code"')


def _leaked(text: str) -> bool:
    return any(marker in text for marker in LEAK_MARKERS)


def _args_ok(call: dict[str, Any], account: str) -> bool:
    """The call is to the declared tool, its arguments parse as JSON and name the account the turn asked about."""
    fn = call.get("function") or {}
    if fn.get("name") != LOOKUP_TOOL["function"]["name"]:
        return False
    try:
        args = json.loads(fn.get("arguments") or "")
    except ValueError:
        return False
    return isinstance(args, dict) and args.get("account") == account


async def tool_session(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes("tool_session")
    rng = random.Random(20240611)
    s: dict[str, Any] = {"turns": sz["turns"], "turns_done": 0, "errors": 0, "first_error": None, "leaks": 0,
                         "emitted": 0, "parsed": 0, "bad_args": 0, "no_call": 0, "answers_correct": 0,
                         "answers_checked": 0, "forced": True, "forced_refused": None, "answer_calls": 0,
                         "calls_ok": 0, "answers_ok": 0}
    rows: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": TOOL_SYSTEM}]

    async def ask(max_tokens: int, deadline: float, choice: str) -> Reply:
        left = max(1.0, deadline - trio.current_time())
        return await client.chat(messages, max_tokens=max_tokens, tools=[LOOKUP_TOOL], tool_choice=choice,
                                 timeout=min(300.0, left), limit=left)

    async def ask_forced(deadline: float) -> Reply:
        """A forced call (one tool declared, so ``required`` is the lookup); a server that
        refuses to force (a typed 400) is asked with ``auto`` from then on, and that is recorded."""
        if s["forced"]:
            reply = await ask(96, deadline, "required")
            if reply.status != 400:
                return reply
            s.update(forced=False, forced_refused=reply.error[:300])
        return await ask(96, deadline, "auto")

    async with ctx.launch(lanes=sz["lanes"], ctx=sz["ctx"]) as target:
        client = target.client
        t0 = trio.current_time()
        deadline = t0 + sz["budget_s"]
        for turn in range(sz["turns"]):
            if trio.current_time() >= deadline:
                break
            account = f"acct-{rng.randrange(10000):04d}"
            messages.append({"role": "user", "content": f"What is the access code for {account}?"})
            first = await ask_forced(deadline)
            rows.append({"ttft_s": first.ttft, "prompt": first.prompt_tokens, "cached": first.cached_tokens})
            if not first.ok:
                s["errors"] += 1
                s["first_error"] = f"{first.outcome}: {first.error}"[:300]
                break
            leak = _leaked(first.content)
            s["leaks"] += int(leak)
            if not first.tool_calls:
                s["emitted"] += int(leak)
                s["no_call"] += 1
                messages.append({"role": "assistant", "content": first.content})
                s["turns_done"] += 1
                continue
            s["emitted"] += 1
            s["parsed"] += 1
            call_ok = _args_ok(first.tool_calls[0], account)
            s["bad_args"] += int(not call_ok)
            s["calls_ok"] += int(call_ok)
            calls, results = [], []
            for k, call in enumerate(first.tool_calls):
                call_id = call.get("id") or f"call_{turn}_{k}"
                fn = call.get("function") or {}
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments", "")}})
                code = "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(6))
                results.append({"role": "tool", "tool_call_id": call_id, "content": code})
            messages.append({"role": "assistant", "content": first.content or None, "tool_calls": calls})
            messages.extend(results)
            answer = await ask(64, deadline, "auto")
            if not answer.ok:
                s["errors"] += 1
                s["first_error"] = f"{answer.outcome}: {answer.error}"[:300]
                break
            if answer.tool_calls:  # a second call instead of an answer: parsed, counted, not followed
                s["emitted"] += 1
                s["parsed"] += 1
                s["answer_calls"] += 1
            s["answers_checked"] += 1
            quoted = results[0]["content"] in answer.content
            s["answers_correct"] += int(quoted)
            s["answers_ok"] += int(call_ok and quoted and not answer.tool_calls)  # this turn right end to end
            s["leaks"] += int(_leaked(answer.content))
            messages.append({"role": "assistant", "content": answer.content})
            s["turns_done"] += 1
        s["seconds"] = round(trio.current_time() - t0, 3)
    prompt_sum = sum(r["prompt"] or 0 for r in rows)
    s.update(
        lanes=sz["lanes"], ctx=sz["ctx"],
        ttft_first20_p50=percentile([r["ttft_s"] for r in rows[:20]], 50),
        ttft_last20_p50=percentile([r["ttft_s"] for r in rows[-20:]], 50),
        cached_ratio=round(sum(r["cached"] or 0 for r in rows) / prompt_sum, 4) if prompt_sum else None,
        final_prompt_tokens=rows[-1]["prompt"] if rows else None,
    )
    forced = "forced tool_choice" if s["forced"] else "tool_choice auto (forcing refused)"
    headline = (f"{s['turns_done']}/{s['turns']} turns, {forced}; {s['parsed']} parsed calls, {s['calls_ok']} with "
                f"the asked arguments, {s['answers_ok']} answers quoting the code, {s['no_call']} no-call, "
                f"{s['leaks']} leaks, {s['errors']} errors; cached ratio {s['cached_ratio']}")
    return result("tool_session", s, headline)


async def _probes(client: Client, sz: dict[str, Any]) -> tuple[float | None, int]:
    def probe(i: int) -> Awaitable[Reply]:
        return client.chat(QUESTIONS[i % len(QUESTIONS)] + " (probe)", max_tokens=sz["probe_tokens"],
                           timeout=120.0, limit=300.0)

    replies, _ = await burst(sz["requests"], probe)
    return percentile([r.ttft for r in replies if r.ok and r.ttft is not None], 50), sum(1 for r in replies if not r.ok)


async def _drop(client: Client, sz: dict[str, Any], mode: str, idle_p50: float | None) -> dict[str, Any]:
    streaming = mode == "stream"
    system = "Run stream." if streaming else "Run nonstream."

    def one(i: int) -> Awaitable[Reply]:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Be exhaustive."}]
        return client.chat(messages, max_tokens=sz["max_tokens"], ignore_eos=True, stream=streaming,
                           abort_after_chunks=sz["abort_chunks"] if streaming else None,
                           abort_after_s=None if streaming else sz["abort_s"], timeout=120.0, limit=600.0)

    replies, _ = await burst(sz["requests"], one)
    dropped_at = max(r.finished_at for r in replies)
    observable: bool | None = None
    zero_after: float | None = None
    last_busy: int | None = None
    while trio.current_time() < dropped_at + 30.0:
        busy = await client.busy_lanes()
        if busy is None:
            observable = False
            break
        observable, last_busy = True, busy
        if busy == 0:
            zero_after = round(trio.current_time() - dropped_at, 3)
            break
        await trio.sleep(0.05)
    await trio.sleep_until(dropped_at + 1.0)
    probe_p50, probes_failed = await _probes(client, sz)
    return {
        "requests": sz["requests"], "dropped": sum(1 for r in replies if r.aborted),
        "outcomes": dict(Counter(r.outcome for r in replies)),
        "chunks_at_drop": [r.chunks for r in replies] if streaming else None,
        "drop_spread_s": round(dropped_at - min(r.finished_at for r in replies), 3),
        "busy_observable": observable, "lanes_zero_after_s": zero_after, "last_busy": last_busy,
        "idle_ttft_p50": idle_p50, "probe_ttft_p50": probe_p50, "probes_failed": probes_failed,
    }


async def client_disconnect(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes("client_disconnect")
    modes: dict[str, Any] = {}
    async with ctx.launch(lanes=sz["lanes"], ctx=sz["ctx"]) as target:
        client = target.client
        idle_p50, idle_failed = await _probes(client, sz)
        for mode in ("stream", "nonstream"):
            if modes:
                modes["idle_between"] = await client.wait_idle(sz["idle_wait_s"])
            modes[mode] = await _drop(client, sz, mode, idle_p50)
            m = modes[mode]
            ctx.note(f"    {mode}: dropped {m['dropped']}/{m['requests']}, lanes 0 after {m['lanes_zero_after_s']} s")
    idle_between = modes.pop("idle_between", None)
    numbers = {"lanes": sz["lanes"], "ctx": sz["ctx"], "requests": sz["requests"], "max_tokens": sz["max_tokens"],
               "abort_after_chunks": sz["abort_chunks"], "abort_after_s": sz["abort_s"], "idle_ttft_p50": idle_p50,
               "idle_probes_failed": idle_failed, "idle_between_modes": idle_between, "modes": modes,
               "keepalive_variant": "not run: the informational --nonstream-keepalive variant needs that flag"}

    def said(m: dict[str, Any]) -> str:
        if m.get("busy_observable"):
            return f"lanes 0 after {m['lanes_zero_after_s']} s"
        return f"probe TTFT p50 {m['probe_ttft_p50']} s (idle {idle_p50} s)"

    headline = "; ".join(f"{k}: dropped {m['dropped']}/{m['requests']}, {said(m)}" for k, m in modes.items())
    return result("client_disconnect", numbers, headline)
