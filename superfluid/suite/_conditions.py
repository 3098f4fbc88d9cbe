"""Pass conditions: pure functions over a scenario's recorded numbers.

Each check takes the ``numbers`` dict a scenario wrote into its result file
and returns a :class:`Check` (passed, and one line saying why). No I/O and no
clocks, so each can be tested on recorded fixtures, and re-judged later from
a result file alone. Thresholds are constants: scales shrink sizes, never the
bar.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

__all__ = ["CHECKS", "CONDITIONS", "FEATURES", "Check", "judge", "judge_features", "majority", "prefix_prefills",
           "rejudge", "result", "tool_turns_needed", "unsupported"]

OK_OR_TYPED = ("ok", "http", "event")
CHAT_TTFT_LIMIT_S = 1.0
AGENT_STALL_LIMIT_S = 30.0
LANES_FREE_WITHIN_S = 1.0
PREFIX_PREFILLS_MAX = 2.0
SHARED_TTFT_RATIO_MAX = 0.5
TOOL_TURNS_GOOD = (10, 12)  # tool_session: at least 10 of every 12 turns right (issue #42)


@attrs.frozen
class Check:
    passed: bool
    why: str
    inconclusive: bool = False  # the run could not show the property either way (not a pass, not a fail)


def _fail(why: str) -> Check:
    return Check(False, why)


def _diverges(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # up to the shorter
        if x != y:
            break
        n += 1
    return n


def _describe(reply: dict[str, Any]) -> str:
    outcome = reply.get("outcome", "?")
    err = reply.get("error")
    return f"{outcome} ({err})" if err else str(outcome)


def worker_kill(n: dict[str, Any]) -> Check:
    if not n.get("workers_killed"):
        return _fail(f"no worker was killed ({n.get('kill_note') or 'the kill point was never reached'})")
    ref = n.get("reference_text") or ""
    cut = n.get("cut") or {}
    cut_text = cut.get("text") or ""
    completed = cut.get("outcome") == "ok" and cut_text == ref
    typed = cut.get("outcome") in ("http", "event")
    if not (completed or typed):
        if cut.get("outcome") == "ok":
            return _fail(f"the cut stream completed with text that differs from the reference "
                         f"(at char {_diverges(cut_text, ref)} of {len(ref)})")
        return _fail(f"the cut stream ended without a typed error: {_describe(cut)}")
    if not ref.startswith(cut_text):
        return _fail(f"delivered text is not a prefix of the reference (diverges at char {_diverges(cut_text, ref)})")
    if n.get("recovery_s") is None:
        return _fail("the server did not serve again without outside help")
    after = n.get("after") or {}
    if after.get("outcome") != "ok":
        return _fail(f"the request after recovery failed: {_describe(after)}")
    if (after.get("text") or "") != ref:
        return _fail(f"the reply after recovery differs from the reference (at char {_diverges(after.get('text') or '', ref)})")
    how = "completed with the full text" if completed else "ended with a typed error"
    return Check(True, f"cut stream {how}; served again after {n['recovery_s']:.2f} s; same text after recovery")


def daemon_restart(n: dict[str, Any]) -> Check:
    if n.get("crashed_at_chunk") is None:
        return _fail("the server was never crashed mid-stream")
    if not n.get("restarted"):
        return _fail(f"did not restart on its state dir: {n.get('start_error') or 'unknown'}")
    first = n.get("first") or {}
    if first.get("outcome") != "ok":
        return _fail(f"the first reply after restart failed: {_describe(first)}")
    ref = n.get("reference_text") or ""
    if (first.get("text") or "") != ref:
        return _fail(f"the first reply after restart differs from the pre-crash reference "
                     f"(at char {_diverges(first.get('text') or '', ref)})")
    return Check(True, f"restarted in {n.get('restart_to_ready_s', 0):.2f} s; same reply as before the crash")


def _agents_pass(name: str, p: dict[str, Any] | None) -> Check:
    if not p:
        return _fail(f"the {name} pass was not run")
    chat = p.get("chat") or {}
    if chat.get("outcome") != "ok":
        return _fail(f"[{name}] the interactive chat failed: {_describe(chat)}")
    ttft = chat.get("ttft_s")
    if ttft is None or ttft > CHAT_TTFT_LIMIT_S:
        return _fail(f"[{name}] interactive TTFT {ttft} s behind the agents exceeds {CHAT_TTFT_LIMIT_S} s")
    if p.get("agents_failed", 0):
        return _fail(f"[{name}] {p['agents_failed']} agent request(s) failed")
    stall = p.get("max_stall_s") or 0.0
    if stall > AGENT_STALL_LIMIT_S:
        return _fail(f"[{name}] an agent stream stalled {stall:.1f} s (> {AGENT_STALL_LIMIT_S:.0f} s)")
    return Check(True, f"[{name}] chat TTFT {ttft:.2f} s behind the agents; no agent failed or stalled")


def resume_by_id(n: dict[str, Any]) -> Check | None:
    """The feature row: the stream cut by the crash, resumed by id after the restart
    (None: the server has no resumable sessions)."""
    r = n.get("resume")
    if r is None:
        return None
    if not r.get("session"):
        return _fail("the crashed stream named no session id (x-superfluid-session)")
    if r.get("outcome") != "ok":
        return _fail(f"GET /v1/sessions/{{id}}/stream after the restart failed: {_describe(r)}")
    ref = n.get("reference_text") or ""
    whole = (r.get("delivered") or "") + (r.get("text") or "")
    if whole != ref:
        return _fail(f"delivered + resumed text differs from the reference (at char {_diverges(whole, ref)} of "
                     f"{len(ref)})")
    return Check(True, f"resumed from event {r.get('after')} after the restart; delivered + resumed text equals "
                       f"the reference")


def agents_interactive(n: dict[str, Any]) -> Check:
    """Every system is judged on the same pass: plain requests, no QoS headers."""
    if n.get("agents", 0) >= n.get("lanes", 0):
        return _fail(f"{n.get('agents')} agents on {n.get('lanes')} lanes leave no lane for the chat: "
                     f"the setup does not test scheduling")
    return _agents_pass("plain", (n.get("passes") or {}).get("plain"))


def agents_with_qos(n: dict[str, Any]) -> Check | None:
    """The feature row: the same load with ``x-superfluid-qos`` headers (None: the server takes none)."""
    p = (n.get("passes") or {}).get("qos")
    return None if p is None else _agents_pass("qos", p)


def kv_exhaustion(n: dict[str, Any]) -> Check:
    """Every request completes (queued until it fits, not refused): a typed refusal is no pass."""
    outcomes: dict[str, int] = n.get("outcomes") or {}
    total = sum(outcomes.values())
    if total != n.get("requests"):
        return _fail(f"only {total} of {n.get('requests')} requests were recorded")
    untyped = {k: v for k, v in outcomes.items() if k not in OK_OR_TYPED and v}
    if untyped:
        return _fail("untyped failures: " + ", ".join(f"{v} {k}" for k, v in sorted(untyped.items())))
    refused = total - outcomes.get("ok", 0)
    if refused:
        return _fail(f"{refused} of {total} requests refused with a typed error instead of queued to completion")
    fresh = n.get("fresh") or {}
    if fresh.get("outcome") != "ok":
        return _fail(f"the fresh request after the burst failed: {_describe(fresh)}")
    return Check(True, f"all {total} requests completed (none refused); fresh request ok")


def unload_reload(n: dict[str, Any]) -> Check:
    status = n.get("unload_status")
    if not isinstance(status, int) or not 200 <= status < 300:
        return _fail(f"the unload call was not accepted: {n.get('unload_error') or f'HTTP {status}'}")
    for i, s in enumerate(n.get("streams") or []):
        if s.get("outcome") not in OK_OR_TYPED:
            return _fail(f"in-flight stream {i} ended without a typed error: {_describe(s)}")
    if not n.get("served_again"):
        return _fail(f"the model did not serve again ({n.get('reload_note') or 'no reload path worked'})")
    return Check(True, f"in-flight streams ok or typed; served again ({n.get('reloaded_by')})")


def tool_turns_needed(turns: int) -> int:
    """Turns of ``turns`` that must each carry a valid call with the asked arguments (10 of 12)."""
    good, of = TOOL_TURNS_GOOD
    return -(-turns * good // of)


def _tool_counts(n: dict[str, Any]) -> tuple[int, int]:
    """(turns whose forced request returned a valid lookup_code call with the asked account, turns
    whose answer then quoted the code the tool returned). Older result files have no ``calls_ok``:
    their first calls are the parsed ones less the calls made instead of an answer, less bad args."""
    calls_ok = n.get("calls_ok")
    if calls_ok is None:
        calls_ok = n.get("parsed", 0) - n.get("answer_calls", 0) - n.get("bad_args", 0)
    answers_ok = n.get("answers_ok")
    if answers_ok is None:
        answers_ok = n.get("answers_correct", 0)
    return max(0, int(calls_ok)), max(0, int(answers_ok))


def tool_session(n: dict[str, Any]) -> Check:
    if n.get("errors", 0):
        return _fail(f"request error at turn {n.get('turns_done', 0) + 1}: {n.get('first_error')}")
    if n.get("leaks", 0):
        return _fail(f"{n['leaks']} turn(s) leaked tool-call markup into the content")
    if n.get("emitted") != n.get("parsed"):
        return _fail(f"{n.get('emitted')} tool calls emitted but {n.get('parsed')} parsed")
    turns = n.get("turns") or 0
    if n.get("turns_done") != turns:
        return _fail(f"only {n.get('turns_done')} of {turns} turns done within the time budget")
    if not n.get("parsed"):
        return Check(False, f"{turns} turns without a single tool call: nothing about tool calls was "
                            f"shown", inconclusive=True)
    need = tool_turns_needed(turns)
    calls_ok, answers_ok = _tool_counts(n)
    if calls_ok < need:
        return _fail(f"{calls_ok} of {turns} turns had a valid call with the asked arguments (needs {need})")
    if answers_ok < need:
        return _fail(f"{answers_ok} of {turns} turns' answers quoted the code the tool returned (needs {need})")
    return Check(True, f"{calls_ok} of {turns} turns with a valid call and the asked arguments, {answers_ok} "
                       f"answers quoting the returned code (needs {need}); no leaks, no errors")


def _disconnect_mode(name: str, m: dict[str, Any]) -> Check:
    if not m:
        return _fail(f"{name}: not run")
    if m.get("dropped", 0) != m.get("requests"):
        return _fail(f"{name}: {m.get('requests', 0) - m.get('dropped', 0)} request(s) ended before the client "
                     f"dropped them, so nothing was tested")
    if m.get("probes_failed", 0):
        return _fail(f"{name}: {m['probes_failed']} probe(s) after the drop failed")
    if m.get("busy_observable"):
        t = m.get("lanes_zero_after_s")
        if t is None:
            return _fail(f"{name}: busy lanes never reached 0 after the disconnect")
        if t > LANES_FREE_WITHIN_S:
            return _fail(f"{name}: busy lanes reached 0 only {t:.2f} s after the disconnect "
                         f"(> {LANES_FREE_WITHIN_S} s)")
        return Check(True, f"{name}: lanes free {t:.2f} s after the drop")
    idle, probe = m.get("idle_ttft_p50"), m.get("probe_ttft_p50")
    if idle is None or probe is None:
        return _fail(f"{name}: no probe latency to compare")
    if probe > 2 * idle + 0.5:
        return _fail(f"{name}: probe TTFT p50 {probe:.2f} s after the drop > 2 x idle {idle:.2f} s + 0.5 s")
    return Check(True, f"{name}: probe TTFT p50 {probe:.2f} s vs idle {idle:.2f} s")


def client_disconnect(n: dict[str, Any]) -> Check:
    modes = n.get("modes") or {}
    checks = [_disconnect_mode(k, modes.get(k) or {}) for k in ("stream", "nonstream")]
    for c in checks:
        if not c.passed:
            return c
    return Check(True, "; ".join(c.why for c in checks))


def prefix_prefills(n: dict[str, Any]) -> float | None:
    """How many times the shared prefix was prefilled: the server's prefilled-token count for
    the shared burst, less every request's own tail, over the prefix length.

    ``prefilled_tokens`` comes from the server's counters (superfluid's
    ``superfluid_prefill_tokens_total``, llama-server's per-response ``timings.prompt_n``) or,
    without them, from token counts (prompt − cached per request). The prefix length is the
    longest prompt prefix the server reported reusing (``cached_tokens``); a burst with no reuse
    at all prefilled the prefix once per request. None without a count to start from."""
    prefilled = n.get("prefilled_tokens")
    prompts = [p for p in n.get("prompt_tokens_per_request") or [] if p]
    if prefilled is None or not prompts or len(prompts) != n.get("requests"):
        return None
    prefix = min(int(n.get("prefix_tokens") or 0), min(prompts))
    if prefix <= 0:
        return float(len(prompts))
    tails = sum(p - prefix for p in prompts)
    return round((prefilled - tails) / prefix, 3)


def shared_prefix(n: dict[str, Any]) -> Check:
    if n.get("shared_failed", 0):
        return _fail(f"{n['shared_failed']} request(s) of the shared burst failed")
    prefills = prefix_prefills(n)
    if prefills is not None:
        if prefills > PREFIX_PREFILLS_MAX:
            return _fail(f"the shared prefix was prefilled {prefills:.2f} times (> {PREFIX_PREFILLS_MAX:.0f}; "
                         f"{n.get('prefilled_source')})")
        return Check(True, f"shared prefix prefilled {prefills:.2f} times for {n.get('requests')} requests "
                           f"({n.get('prefilled_source')})")
    shared, cold = n.get("shared_ttft_p50"), n.get("cold_ttft_p50")
    if shared is None or cold is None:
        return _fail("no prefilled-token count and no TTFT to compare")
    if shared > SHARED_TTFT_RATIO_MAX * cold:
        return _fail(f"shared TTFT p50 {shared:.2f} s > {SHARED_TTFT_RATIO_MAX} x cold {cold:.2f} s "
                     f"(no prefilled-token count)")
    return Check(True, f"shared TTFT p50 {shared:.2f} s vs cold {cold:.2f} s")


CHECKS: dict[str, Callable[[dict[str, Any]], Check]] = {
    "worker_kill": worker_kill, "daemon_restart": daemon_restart, "agents_interactive": agents_interactive,
    "kv_exhaustion": kv_exhaustion, "unload_reload": unload_reload, "tool_session": tool_session,
    "client_disconnect": client_disconnect, "shared_prefix": shared_prefix,
}

CONDITIONS = {
    "worker_kill": "the cut stream ends with a typed error or completes with the reference text; what it delivered "
                   "is a prefix of the reference; the server serves again by itself; the next reply equals the "
                   "reference",
    "daemon_restart": "the server restarts on its state dir and the first reply after restart equals the "
                      "pre-crash reference (resuming the cut stream by id is a feature row, n/a where the "
                      "server has no resumable sessions)",
    "agents_interactive": f"the chat succeeds with TTFT <= {CHAT_TTFT_LIMIT_S:g} s, no agent fails and no agent "
                          f"stream stalls > {AGENT_STALL_LIMIT_S:g} s, fewer agents than lanes; every system is "
                          f"judged on the plain pass (no QoS headers); the QoS-header pass is a feature row",
    "kv_exhaustion": "every request completes (queued until it fits; a typed refusal, HTTP error or SSE error "
                     "event, is not a pass), none reset, timed out, truncated or malformed; a fresh request "
                     "afterwards succeeds",
    "unload_reload": "the unload call is accepted, every in-flight stream ends ok or with a typed error, and the "
                     "model serves again",
    "tool_session": f"each turn's first request forces a tool call (tool_choice required); at least "
                    f"{TOOL_TURNS_GOOD[0]} of every {TOOL_TURNS_GOOD[1]} turns get a valid lookup_code call with the "
                    f"account the turn asked about, and as many answers quote the code the tool returned; no "
                    f"tool-call markup leaks into content, every emitted call is parsed, every turn is done, no "
                    f"request fails; zero parsed calls is inconclusive",
    "client_disconnect": f"in both modes (stream, non-stream) every request was dropped mid-generation, probes "
                         f"after the drop succeed, and busy lanes reach 0 within {LANES_FREE_WITHIN_S:g} s where "
                         f"observable (else probe TTFT p50 <= 2 x idle + 0.5 s)",
    "shared_prefix": f"the shared burst has no failures and the shared prefix is prefilled at most "
                     f"{PREFIX_PREFILLS_MAX:g} times, counted from the server's prefilled tokens (its counters, else "
                     f"prompt - cached per request) over the longest reported cache hit (without a count: shared "
                     f"TTFT p50 <= {SHARED_TTFT_RATIO_MAX:g} x cold)",
}


FEATURES: dict[str, dict[str, Callable[[dict[str, Any]], Check | None]]] = {
    "agents_interactive": {"with QoS headers": agents_with_qos},
    "daemon_restart": {"resume by id": resume_by_id},
}


def judge(scenario: str, numbers: dict[str, Any]) -> Check:
    return CHECKS[scenario](numbers)


def _verdict(check: Check) -> str:
    return "pass" if check.passed else "inconclusive" if check.inconclusive else "fail"


JUDGED = ("pass", "fail", "inconclusive")  # verdicts a check gave (error and unsupported come from the runner)


def rejudge(cell: dict[str, Any]) -> tuple[str, str]:
    """(verdict, why) of one run under the current checks: a judged run's recorded numbers are
    judged again (a result file is re-judged from itself, so stricter rules apply to old runs);
    an error or ``unsupported`` stands as recorded."""
    verdict = cell.get("verdict", "error")
    numbers = cell.get("numbers")
    scenario = cell.get("scenario")
    if verdict not in JUDGED or not numbers or scenario not in CHECKS:
        return verdict, str(cell.get("reason") or "")
    check = judge(scenario, numbers)
    return _verdict(check), "" if check.passed else check.why


def majority(verdicts: list[str]) -> str:
    """The verdict more than half of a cell's runs gave; with none, ``inconclusive`` (the runs disagree)."""
    for v in dict.fromkeys(verdicts):
        if 2 * verdicts.count(v) > len(verdicts):
            return v
    return "inconclusive"


def judge_features(scenario: str, numbers: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Feature rows, reported beside the scored verdict: label -> verdict (``unsupported`` where
    the server lacks the feature) and why."""
    out = {}
    for label, check_of in FEATURES.get(scenario, {}).items():
        check = check_of(numbers)
        out[label] = ({"verdict": "unsupported", "why": "the server does not offer it"} if check is None
                      else {"verdict": _verdict(check), "why": check.why})
    return out


def result(scenario: str, numbers: dict[str, Any], headline: str) -> dict[str, Any]:
    """A scenario's result: the verdict comes from its check over ``numbers``."""
    check = judge(scenario, numbers)
    out = {"verdict": _verdict(check), "headline": headline,
           "reason": "" if check.passed else check.why, "check": check.why,
           "condition": CONDITIONS[scenario], "numbers": numbers}
    features = judge_features(scenario, numbers)
    if features:
        out["features"] = features
    return out


def unsupported(scenario: str, reason: str) -> dict[str, Any]:
    out: dict[str, Any] = {"verdict": "unsupported", "headline": reason, "reason": reason,
                           "condition": CONDITIONS[scenario], "numbers": {}}
    if scenario in FEATURES:
        out["features"] = {label: {"verdict": "unsupported", "why": reason} for label in FEATURES[scenario]}
    return out
