"""The suite's scoring rules (issue #42): the headline on the scenarios both systems ran,
``inconclusive`` counted apart from ``fail``, ``tool_session`` judged on 10 of 12 turns' calls,
arguments and answers, ``kv_exhaustion`` passed only when every request completes, and
``--repeat N``: each cell run N times, its verdict the majority, every run listed."""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from superfluid.suite import judge
from superfluid.suite._behaviour import _args_ok, tool_session
from superfluid.suite._cli import build_parser
from superfluid.suite._compare import compare
from superfluid.suite._conditions import majority, result, tool_turns_needed, unsupported
from superfluid.suite._corpus import SCALES
from superfluid.suite._process import Context
from superfluid.suite._runner import SCENARIOS, RunOptions, combine_runs, run
from superfluid.suite._systems import attached_spec

from .test_suite_conditions import SSE_HEAD, _chunked, _sse, fixture


def _write(d: Path, scenario: str, system: str, res: dict[str, Any]) -> None:
    res = {**res, "scenario": scenario, "system": system}
    (d / f"{scenario}--{system}.json").write_text(json.dumps(res))


def _cell(scenario: str, kind: str) -> dict[str, Any]:
    """A pass or fail result of ``scenario`` from its fixtures; ``na``, ``inconclusive`` or ``error`` too."""
    if kind == "na":
        return unsupported(scenario, "not offered")
    if kind == "error":
        return {"verdict": "error", "headline": "error: boom", "reason": "boom", "numbers": {}}
    if kind == "inconclusive":
        n = fixture("tool_session--pass")
        n.update(parsed=0, emitted=0, calls_ok=0, answers_ok=0, no_call=n["turns"])
        return result("tool_session", n, "no calls")
    return result(scenario, fixture(f"{scenario}--{kind}"), kind)


# -- the headline: passes on the scenarios both systems ran, each system's own total beside it -----------------

def test_the_headline_is_scored_on_the_scenarios_both_systems_ran(tmp_path: Path) -> None:
    ours = dict.fromkeys(SCENARIOS, "pass")
    theirs = {"worker_kill": "na", "daemon_restart": "pass", "agents_interactive": "fail", "kv_exhaustion": "pass",
              "unload_reload": "na", "tool_session": "inconclusive", "client_disconnect": "fail",
              "shared_prefix": "fail"}
    for scenario in SCENARIOS:
        _write(tmp_path, scenario, "ours", _cell(scenario, ours[scenario]))
        _write(tmp_path, scenario, "theirs", _cell(scenario, theirs[scenario]))
    text = compare([tmp_path])
    # 8/8 against 2/6 compares two denominators; on the 5 scenarios both ran it is 5/5 against 2/5
    assert "**On the 5 scenarios both systems ran**" in text
    assert "ours **5/5**, theirs **2/5**" in text
    assert "| **passes on the 5 scenarios both ran** | 5/5 | 2/5 |" in text
    assert "| **passes / applicable** (own total) | 8/8 | 2/6 |" in text
    assert text.index("passes on the 5 scenarios both ran") < text.index("(own total)")


def test_an_error_counts_as_ran_and_not_passed_in_the_headline(tmp_path: Path) -> None:
    _write(tmp_path, "worker_kill", "ours", _cell("worker_kill", "pass"))
    _write(tmp_path, "worker_kill", "theirs", _cell("worker_kill", "error"))
    _write(tmp_path, "kv_exhaustion", "ours", _cell("kv_exhaustion", "pass"))
    _write(tmp_path, "kv_exhaustion", "theirs", _cell("kv_exhaustion", "na"))
    text = compare([tmp_path])
    assert "| **passes on the 1 scenarios both ran** | 1/1 | 0/1 |" in text  # the error is in, the n/a is out


def test_inconclusive_is_reported_apart_from_fail(tmp_path: Path) -> None:
    _write(tmp_path, "tool_session", "peer", _cell("tool_session", "inconclusive"))
    _write(tmp_path, "kv_exhaustion", "peer", _cell("kv_exhaustion", "fail"))
    _write(tmp_path, "worker_kill", "peer", _cell("worker_kill", "error"))
    _write(tmp_path, "unload_reload", "peer", _cell("unload_reload", "na"))
    text = compare([tmp_path])
    assert "| tool_session | inconclusive |" in text and "| kv_exhaustion | **FAIL** |" in text
    assert "| fail / inconclusive / error / n/a | 1 / 1 / 1 / 1 |" in text
    assert "| **passes / applicable** (own total) | 0/3 |" in text


# -- tool_session: at least 10 of 12 turns with a valid call, the asked arguments and a right answer ------------

def _tools(turns: int, calls_ok: int, answers_ok: int | None = None) -> dict[str, Any]:
    n = fixture("tool_session--pass")
    n.update(turns=turns, turns_done=turns, emitted=turns, parsed=turns, calls_ok=calls_ok,
             answers_ok=calls_ok if answers_ok is None else answers_ok, bad_args=turns - calls_ok)
    return n


def test_tool_session_needs_10_of_12_turns_with_a_valid_call_and_the_asked_arguments() -> None:
    assert tool_turns_needed(12) == 10 and tool_turns_needed(40) == 34 and tool_turns_needed(200) == 167
    assert judge("tool_session", _tools(12, 10)).passed
    check = judge("tool_session", _tools(12, 9))
    assert not check.passed and not check.inconclusive
    assert "9 of 12 turns had a valid call with the asked arguments (needs 10)" in check.why
    # one parsed call in 12 turns used to pass
    one = _tools(12, 1)
    one.update(parsed=1, emitted=1, no_call=11)
    assert not judge("tool_session", one).passed
    # the answers are judged too: the code the tool returned, quoted
    check = judge("tool_session", _tools(12, 12, answers_ok=9))
    assert not check.passed and "9 of 12 turns' answers quoted the code" in check.why


def test_tool_session_judges_old_result_files_from_their_counts() -> None:
    n = _tools(12, 12)
    del n["calls_ok"], n["answers_ok"]
    n.update(bad_args=0, answer_calls=0, answers_correct=12)
    assert judge("tool_session", n).passed
    n.update(bad_args=3)  # 9 first calls with the asked account
    assert "9 of 12 turns had a valid call" in judge("tool_session", n).why


def test_a_calls_arguments_are_judged_against_what_the_turn_asked() -> None:
    def call(name: str, args: Any) -> dict[str, Any]:
        return {"function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}

    assert _args_ok(call("lookup_code", {"account": "acct-0042"}), "acct-0042")
    assert not _args_ok(call("lookup_code", {"account": "acct-0043"}), "acct-0042")
    assert not _args_ok(call("lookup_code", {"acct": "acct-0042"}), "acct-0042")
    assert not _args_ok(call("lookup_code", '{"account": "acct-0042"'), "acct-0042")
    assert not _args_ok(call("other_tool", {"account": "acct-0042"}), "acct-0042")


async def _wrong_server(stream: trio.SocketStream, wrong: str) -> None:
    """Forced: calls lookup_code with ``wrong`` ("account": another account; else the right one);
    unforced: answers, without the code when ``wrong`` is "answer"."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                  0)
    while len(body) < length:
        body += await stream.receive_some(65536)
    if head.startswith(b"GET /v1/models"):
        payload = json.dumps({"data": [{"id": "fake"}]}).encode()
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(payload), payload))
        await stream.aclose()
        return
    req = json.loads(body)
    if req.get("tool_choice") == "required":
        account = req["messages"][-1]["content"].split()[-1].rstrip("?")
        if wrong == "account":
            account = "acct-9999" if account != "acct-9999" else "acct-0000"
        call = {"index": 0, "id": "c1", "function": {"name": "lookup_code", "arguments": json.dumps({"account": account})}}
        await stream.send_all(SSE_HEAD + _chunked(_sse({"choices": [{"delta": {"tool_calls": [call]}}]},
                                                       {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})))
    else:
        last = req["messages"][-1]
        text = "Here is your code." if wrong == "answer" else f"The code is {last['content']}."
        await stream.send_all(SSE_HEAD + _chunked(_sse({"choices": [{"delta": {"content": text}}]},
                                                       {"choices": [{"delta": {}, "finish_reason": "stop"}]})))
    await stream.aclose()


@pytest.mark.parametrize("wrong", ["account", "answer"])
async def test_tool_session_fails_a_server_whose_calls_or_answers_are_wrong(tmp_path: Path, wrong: str) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, lambda s: _wrong_server(s, wrong), 0,
                                                host="127.0.0.1"))
        port = int(listeners[0].socket.getsockname()[1])
        ctx = Context(spec=attached_spec("fake", port), scale=SCALES["quick"], run_dir=tmp_path, url_port=port,
                      note=lambda line: None)
        res = await tool_session(ctx)
        nursery.cancel_scope.cancel()
    n = res["numbers"]
    assert n["parsed"] == n["turns"] and n["leaks"] == 0 and n["errors"] == 0  # every call parsed
    assert res["verdict"] == "fail"
    if wrong == "account":
        assert n["calls_ok"] == 0 and n["bad_args"] == n["turns"] and "asked arguments" in res["reason"]
    else:
        assert n["calls_ok"] == n["turns"] and n["answers_ok"] == 0 and "quoted the code" in res["reason"]


# -- kv_exhaustion: every request completes; a typed refusal is no pass ------------------------------------------

def test_kv_exhaustion_passes_only_when_every_request_completes() -> None:
    n = fixture("kv_exhaustion--pass")
    assert judge("kv_exhaustion", n).passed
    refused = copy.deepcopy(n)
    refused["outcomes"] = {"ok": 10, "http": 6}  # refused with a typed 503: used to pass
    check = judge("kv_exhaustion", refused)
    assert not check.passed and "6 of 16 requests refused with a typed error" in check.why
    everyone = copy.deepcopy(n)
    everyone["outcomes"] = {"http": 16}  # every request refused, typed
    assert not judge("kv_exhaustion", everyone).passed


# -- --repeat N: the majority of N runs, every run listed ----------------------------------------------------------

def test_majority_of_runs() -> None:
    assert majority(["pass", "pass", "fail"]) == "pass"
    assert majority(["fail", "pass", "fail"]) == "fail"
    assert majority(["pass", "fail", "inconclusive"]) == "inconclusive"  # no majority: not a pass
    assert majority(["pass", "fail"]) == "inconclusive"
    assert majority(["pass"]) == "pass"


def test_repeat_runs_each_cell_n_times_and_takes_the_majority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = iter(["pass", "fail", "pass", "fail", "fail", "pass"])
    calls: list[str] = []

    async def scripted(ctx: Context) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()   # (a scenario is a coroutine the runner awaits)
        kind = next(kinds)
        calls.append(kind)
        return result("kv_exhaustion", fixture(f"kv_exhaustion--{kind}"), f"run {len(calls)}: {kind}")

    monkeypatch.setitem(SCENARIOS, "kv_exhaustion", scripted)
    out = tmp_path / "r"
    opts = RunOptions(systems=("superfluid-mock",), scenarios=("kv_exhaustion",), scale="quick", out=out,
                      url="http://127.0.0.1:9", cooldown_s=0, repeat=3)
    assert trio.run(run, opts) == 0  # pass, fail, pass: a pass
    cell = json.loads((out / "kv_exhaustion--superfluid-mock.json").read_text())
    assert cell["verdict"] == "pass" and cell["repeat"] == 3
    assert [r["verdict"] for r in cell["runs"]] == ["pass", "fail", "pass"]
    assert all(r["numbers"] for r in cell["runs"])
    assert cell["headline"].endswith("[runs: pass, fail, pass]")
    text = compare([out])
    assert "| kv_exhaustion | pass |" in text and "3 runs (pass, fail, pass): the verdict is their majority" in text
    # a second cell's runs fail twice in three: the majority is a fail
    out2 = tmp_path / "r2"
    assert trio.run(run, attrs.evolve(opts, out=out2)) == 1
    cell = json.loads((out2 / "kv_exhaustion--superfluid-mock.json").read_text())
    assert cell["verdict"] == "fail" and [r["verdict"] for r in cell["runs"]] == ["fail", "fail", "pass"]
    assert len(calls) == 6
    # resumed with a larger N, the recorded runs are kept and only the missing ones run
    monkeypatch.setitem(SCENARIOS, "kv_exhaustion", scripted)
    kinds = iter(["pass", "pass"])
    assert trio.run(run, attrs.evolve(opts, out=out2, repeat=5)) == 0
    cell = json.loads((out2 / "kv_exhaustion--superfluid-mock.json").read_text())
    assert [r["verdict"] for r in cell["runs"]] == ["fail", "fail", "pass", "pass", "pass"] and cell["verdict"] == "pass"


def test_compare_rejudges_every_run_under_the_current_rules(tmp_path: Path) -> None:
    refused = fixture("kv_exhaustion--pass")
    refused["outcomes"] = {"ok": 10, "http": 6}
    old = {"verdict": "pass", "headline": "h", "reason": "", "numbers": refused}  # judged pass by the old rule
    runs = [old, {**old, "numbers": fixture("kv_exhaustion--pass")}, old]
    _write(tmp_path, "kv_exhaustion", "peer", {**combine_runs(runs, 3), "verdict": "pass"})
    text = compare([tmp_path])
    assert "| kv_exhaustion | **FAIL** |" in text
    assert "re-judged under the current pass condition: recorded pass, pass, pass" in text
    assert "3 runs (fail, pass, fail)" in text


def test_the_repeat_flag_defaults_to_one() -> None:
    assert build_parser().parse_args(["run", "--systems", "x"]).repeat == 1
    assert build_parser().parse_args(["run", "--systems", "x", "--repeat", "3"]).repeat == 3
