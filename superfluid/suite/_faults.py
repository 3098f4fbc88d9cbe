"""Fault scenarios: ``worker_kill``, ``daemon_restart``, ``unload_reload``.

Each takes a :class:`~._process.Context` and returns a result dict; the
verdict comes from the matching check in ``_conditions``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import trio

from ._client import Client
from ._conditions import result, unsupported
from ._corpus import QUESTIONS, document
from ._process import Context, ScenarioError, Server, StartFailed
from ._reply import Reply

__all__ = ["daemon_restart", "unload_reload", "worker_kill"]

NO_CONTROL = "needs process control; --url targets a server the suite did not start"


def _kill_point(wanted: int, reference: Reply) -> int:
    """The chunk to strike at: as asked, but inside the reference reply."""
    return max(1, min(wanted, reference.chunks // 2))


async def _reference(client: Client, messages: list[dict[str, Any]], max_tokens: int) -> Reply:
    ref = await client.chat(messages, max_tokens=max_tokens, timeout=120.0, limit=600.0)
    if not ref.ok:
        raise ScenarioError(f"the uninterrupted reference run failed: {ref.outcome} {ref.error}")
    if ref.chunks < 2:
        raise ScenarioError(f"the reference reply has {ref.chunks} chunk(s); nothing to cut")
    return ref


async def worker_kill(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes("worker_kill")
    if not ctx.spec.caps.worker_pattern:
        return unsupported("worker_kill", "single process: no separate inference worker to kill")
    if not ctx.controllable:
        return unsupported("worker_kill", NO_CONTROL)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    async with ctx.launch(lanes=sz["lanes"], ctx=sz["ctx"]) as target:
        client, server = target.client, target.server
        assert server is not None
        ref = await _reference(client, messages, sz["max_tokens"])
        pids = server.worker_pids()
        if not pids:
            raise ScenarioError(f"no worker process matching {ctx.spec.caps.worker_pattern!r} in the server's group")
        kill_at = _kill_point(sz["kill_chunk"], ref)
        killed: list[int] = []
        struck: dict[str, Any] = {}

        def on_chunk(reply: Reply) -> None:
            if not struck and reply.chunks >= kill_at:
                struck.update(chunk=reply.chunks, at=trio.current_time(), delivered=len(reply.content))
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    except ProcessLookupError:
                        pass

        cut = await client.chat(messages, max_tokens=sz["max_tokens"], timeout=120.0, limit=600.0,
                                on_chunk=on_chunk)
        recovered = await client.wait_ok(sz["recover_s"]) if struck else None
        recovery_s = None if recovered is None else round(trio.current_time() - struck["at"], 3)
        after = await client.chat(messages, max_tokens=sz["max_tokens"], timeout=120.0, limit=600.0)
        respawns = await client.metric("superfluid_worker_respawns_total")
        numbers = {
            "lanes": sz["lanes"], "ctx": sz["ctx"], "max_tokens": sz["max_tokens"], "kill_at_chunk": kill_at,
            "chunks_before_kill": struck.get("chunk"), "workers_killed": len(killed), "worker_pids_before": pids,
            "worker_pids_after": server.worker_pids(), "server_alive": server.alive,
            "reference_chars": len(ref.content), "delivered_chars": len(cut.content),
            "delivered_at_kill_chars": struck.get("delivered"), "recovery_s": recovery_s,
            "worker_respawns": respawns, "reference_text": ref.content,
            "reference": ref.summary(), "cut": cut.summary(text=True), "after": after.summary(text=True),
            "kill_note": None if struck else f"the stream ended after {cut.chunks} chunks, before chunk {kill_at}",
        }
    how = "continued to the end" if cut.ok else f"ended {cut.outcome}"
    rec = f"served again {recovery_s:.2f} s after the kill" if recovery_s is not None else "did not serve again"
    headline = (f"killed {len(killed)} worker(s) at chunk {kill_at}; cut stream {how} "
                f"({len(cut.content)}/{len(ref.content)} chars); {rec}")
    return result("worker_kill", numbers, headline)


def _conversation(doc_tokens: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": document(doc_tokens, 7) + "\n\nSummarise the notes above in three sentences."},
        {"role": "assistant", "content": "The notes describe a serving system's internals."},
        {"role": "user", "content": "Which component is mentioned most, and why might that be?"},
    ]


async def daemon_restart(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes("daemon_restart")
    if not ctx.controllable:
        return unsupported("daemon_restart", NO_CONTROL)
    conv = _conversation(sz["doc"])
    server = Server(ctx.spec, lanes=sz["lanes"], ctx=sz["ctx"], run_dir=ctx.run_dir)
    numbers: dict[str, Any] = {"lanes": sz["lanes"], "ctx": sz["ctx"], "max_tokens": sz["max_tokens"]}
    try:
        await server.start(timeout=sz["start_s"])
        client = server.client()
        ref = await _reference(client, conv, sz["max_tokens"])
        warm = await client.chat(conv, max_tokens=sz["max_tokens"], timeout=120.0, limit=600.0)
        kill_at = _kill_point(sz["kill_chunk"], ref)
        crashed: dict[str, Any] = {}

        def on_chunk(reply: Reply) -> None:
            if not crashed and reply.chunks >= kill_at:
                crashed.update(chunk=reply.chunks)
                server.crash()

        resumable = [("x-superfluid-resumable", "true")] if ctx.spec.caps.resume else []
        crash_reply = await client.chat(conv, max_tokens=sz["max_tokens"], timeout=60.0, limit=600.0,
                                        on_chunk=on_chunk, headers=resumable)
        if not crashed:
            server.crash()
        await server.wait_gone()
        numbers.update(prompt_tokens=ref.prompt_tokens, reference_text=ref.content, kill_at_chunk=kill_at,
                       crashed_at_chunk=crashed.get("chunk"), crash_reply=crash_reply.summary(),
                       ttft_before_cold_s=ref.summary()["ttft_s"], ttft_before_warm_s=warm.summary()["ttft_s"],
                       cached_before_warm=warm.cached_tokens)
        try:
            numbers["restart_to_ready_s"] = round(await server.start(fresh_state=False, timeout=sz["start_s"]), 3)
            numbers["restarted"] = True
        except StartFailed as exc:
            numbers.update(restarted=False, start_error=str(exc))
            return result("daemon_restart", numbers, f"crashed at chunk {crashed.get('chunk')}; did not restart")
        client = server.client()
        if ctx.spec.caps.resume:
            numbers["resume"] = await _resume(client, crash_reply)
        first = await client.chat(conv, max_tokens=sz["max_tokens"], timeout=120.0, limit=600.0)
        second = await client.chat(conv, max_tokens=sz["max_tokens"], timeout=120.0, limit=600.0)
        numbers.update(first=first.summary(text=True), second=second.summary(),
                       ttft_after_cold_s=first.summary()["ttft_s"], ttft_after_warm_s=second.summary()["ttft_s"],
                       cached_after_first=first.cached_tokens, cached_after_second=second.cached_tokens)
    finally:
        await server.stop()  # noqa: ASYNC102 - stop() shields itself, bounded
    if "resume" in numbers:
        r = numbers["resume"]
        resumed = r["delivered"] + (r.get("text") or "")
        same_resume = "equals" if r["outcome"] == "ok" and resumed == ref.content else "differs from"
        numbers["resume_note"] = f"resumed by id: {r['outcome']}, delivered + resumed {same_resume} the reference"
    same = "same reply" if first.ok and first.content == ref.content else f"first reply {first.outcome}, differs"
    headline = (f"crashed at chunk {crashed.get('chunk')}; ready again in {numbers['restart_to_ready_s']:.2f} s; "
                f"{same}; {ref.prompt_tokens} prompt tokens, {first.cached_tokens} cached after restart")
    if "resume_note" in numbers:
        headline += f"; {numbers['resume_note']}"
    return result("daemon_restart", numbers, headline)


async def _resume(client: Client, cut: Reply) -> dict[str, Any]:
    """Resume the stream the crash cut, by id, from the last event it delivered."""
    sid = cut.headers.get("x-superfluid-session")
    out: dict[str, Any] = {"session": sid, "after": cut.last_event_id, "delivered": cut.content}
    if not sid:
        out.update(outcome="missing", error="no x-superfluid-session header on the cut stream")
        return out
    headers = [("Last-Event-ID", cut.last_event_id)] if cut.last_event_id is not None else []
    reply = await client.call("GET", f"/v1/sessions/{sid}/stream", headers=headers, stream=True, timeout=120.0,
                              limit=600.0)
    out.update(reply.summary(text=True))
    return out


async def _reload(client: Client, ctx: Context, model_id: str) -> tuple[Client, int | None, str | None]:
    """The explicit load call; returns a client for the id the model now answers under."""
    r = await client.call("POST", "/v1/models/load", {"model": model_id}, timeout=600.0, limit=600.0)
    if r.status != 200 and ctx.spec.model and ctx.spec.runtime and ctx.spec.runtime != "mock":
        r = await client.call("POST", "/v1/models/load", {"id": ctx.spec.model, "runtime": ctx.spec.runtime},
                              timeout=600.0, limit=600.0)
    new_id = r.body.get("id") if r.status == 200 and isinstance(r.body, dict) and r.body.get("id") else model_id
    fresh = Client(client.host, client.port, model=new_id, qos=client.qos, busy=client.busy)
    return fresh, r.status, None if r.status == 200 else r.error


async def unload_reload(ctx: Context) -> dict[str, Any]:
    sz = ctx.sizes("unload_reload")
    if ctx.spec.caps.unload is None:
        return unsupported("unload_reload", "no unload API")
    async with ctx.launch(lanes=sz["lanes"], ctx=sz["ctx"], companion=True) as target:
        client = target.client
        model_id = client.model or ""
        streams: list[Reply | None] = [None] * sz["streams"]
        n: dict[str, Any] = {"lanes": sz["lanes"], "ctx": sz["ctx"], "model_id": model_id,
                             "companion": ctx.spec.companion if target.server and target.server.companion else None}

        async def stream(i: int) -> None:
            streams[i] = await client.chat(QUESTIONS[i % len(QUESTIONS)], max_tokens=sz["max_tokens"],
                                           timeout=120.0, limit=600.0)

        async def unload_then_ask() -> None:
            await trio.sleep(sz["unload_delay_s"])
            t0 = trio.current_time()
            r = await client.call("POST", "/v1/models/unload", {"model": model_id}, timeout=120.0, limit=300.0)
            n.update(unload_status=r.status, unload_s=round(trio.current_time() - t0, 3),
                     unload_error=None if r.status == 200 else r.error)
            after = await client.chat("Say OK.", max_tokens=4, timeout=300.0, limit=600.0)
            n.update(after=after.summary(), reloaded_by="on demand" if after.ok else None)
            if not after.ok:
                again, status, error = await _reload(client, ctx, model_id)
                after = await again.chat("Say OK.", max_tokens=4, timeout=300.0, limit=600.0)
                n.update(load_status=status, load_error=error, after_load=after.summary(), model_id_after=again.model,
                         reloaded_by="explicit load call" if after.ok else None)
            n["served_again"] = after.ok
            n["service_gap_s"] = round(after.chunk_times[0] - t0, 3) if after.ok and after.chunk_times else None
            if not after.ok:
                n["reload_note"] = f"Say OK. after unload: {after.outcome} {after.error}"[:300]

        async with trio.open_nursery() as nursery:
            for i in range(sz["streams"]):
                nursery.start_soon(stream, i)
            nursery.start_soon(unload_then_ask)
    n["streams"] = [s.summary() if s else {"outcome": "missing"} for s in streams]
    outcomes = ", ".join(s["outcome"] for s in n["streams"])
    gap = f"service gap {n['service_gap_s']:.2f} s" if n.get("service_gap_s") is not None else "no service after"
    headline = f"unload HTTP {n.get('unload_status')} in {n.get('unload_s')} s; streams: {outcomes}; {gap}"
    if n.get("companion") is None and ctx.spec.caps.family == "superfluid":
        n["note"] = "started without a second model: a server that keeps its last model loaded cannot unload it"
    return result("unload_reload", n, headline)
