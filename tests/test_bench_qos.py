"""bench/qos.py's tables from small synthetic logs written into tmp_path: no servers (issue #42).

The agents log has 3 rounds of the four systems; per round, chat TTFT and wall are set so that the
medians, min-max and per-round ratios to llama-server -np 9 are known. Variants break one thing (a
short reply, a system that failed to start, a chat that failed) to check the table shows it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_HDR, HDR, NP8, NP9 = "superfluid, no headers", "superfluid + QoS headers", "llama-server -np 8", "llama-server -np 9"

# system -> per round (chat TTFT s, wall s)
AGENTS = {NO_HDR: [(40.0, 120.0), (50.0, 110.0), (45.0, 130.0)],
          NP9: [(20.0, 100.0), (25.0, 100.0), (30.0, 104.0)],
          HDR: [(0.30, 119.0), (0.50, 121.0), (0.20, 118.0)],
          NP8: [(100.0, 104.0), (90.0, 101.0), (95.0, 103.0)]}


@pytest.fixture(scope="module")
def qos() -> ModuleType:
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location("_bench_qos_test", ROOT / "bench/qos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _header(part: str, systems: list[str], rounds: int, qos: ModuleType) -> dict[str, Any]:
    setups = {NO_HDR: {"kind": "superfluid", "qos": False}, HDR: {"kind": "superfluid", "qos": True},
              NP8: {"kind": "llama-server", "slots": 8}, NP9: {"kind": "llama-server", "slots": 9}}
    argv = {"superfluid": ["python", "-m", "superfluid", "serve", "/m/SmolLM2-135M-Instruct.Q4_1.gguf", "--http",
                           "127.0.0.1:PORT", "--host-cache-mb", "0", "--max-batch", "8", "--sessions", "SESSIONS"],
            "llama-server": ["/b/llama-server", "-m", "/m/SmolLM2-135M-Instruct.Q4_1.gguf", "-c", "40960", "-np", "N",
                             "--cache-ram", "0", "--port", "PORT"]}
    workload = {"agents": {"agents": 8, "agent_prompt": 1300, "agent_reply": 64, "chat_delay_s": 2.0,
                           "chat_tokens": 16, "chat": qos.CHAT_Q},
                "shared": {"requests": 16, "prompt": 1720, "reply": 16},
                "kv": {"requests": 32, "prompt": 2750, "reply": 150}}[part]
    return {"kind": "header", "commit": "abc1234", "started": "2026-12-07 01:00:00 UTC",
            "cpu": "Test CPU (2 cores)", "loadavg": 0.12,
            "args": {"model": "/m/SmolLM2-135M-Instruct.Q4_1.gguf", "runtime": "llamacpp", "parts": part,
                     "rounds": rounds, "kv_rounds": rounds, "threads": 2, "order_seed": 5, "only": None, "size": 1.0},
            "part": part, "runtime": "llamacpp", "rounds": rounds, "order_seed": 5,
            "orders": [systems[r % len(systems):] + systems[:r % len(systems)] for r in range(rounds)],
            "machine": {"cores": 2, "mem_gib": 8.0, "kernel": "6.1", "thp": "[always]", "thp_defrag": "x",
                        "loadavg": [0.12, 0.1, 0.1]},
            "versions": {"superfluid": "abc1234", "llama_cpp_python": "0.3.36", "python": "3.11.7",
                         "llama_server": "version: 1 (abc)"},
            "systems": {s: {**setups[s], "argv": [x.replace("N", str(setups[s].get("slots", ""))) for x in
                                                 argv[setups[s]["kind"]]],
                            "env": {} if setups[s]["kind"] == "superfluid" else {"LD_LIBRARY_PATH": "/b"}}
                        for s in systems},
            "terms": {"lanes": 8, "ctx": 4096, "kv_cells": 40960, "threads": 2, "superfluid_host_cache_mb": 0,
                      "llama_server_cache_ram": 0, "size": 1.0},
            "workload": workload}


def _agents_recs(qos: ModuleType, table: dict[str, list[tuple[float, float]]] = AGENTS) -> list[dict[str, Any]]:
    recs = [_header("agents", list(table), 3, qos)]
    for rnd in range(3):
        for pos, system in enumerate(recs[0]["orders"][rnd]):
            ttft, wall = table[system][rnd]
            for i in range(8):
                recs.append({"kind": "request", "part": "agents", "system": system, "round": rnd, "role": "agent",
                             "index": i, "ttft": 1.0, "completion_tokens": 64, "prompt_tokens": 1800,
                             "cached_tokens": 0, "prompt_n": None, "chunks": 64, "wall": wall - 1, "max_stall": 0.5,
                             "status": "ok", "error": None, "typed": None})
            recs.append({"kind": "request", "part": "agents", "system": system, "round": rnd, "role": "chat",
                         "index": 0, "ttft": ttft, "completion_tokens": 2, "prompt_tokens": 20, "cached_tokens": 0,
                         "prompt_n": None, "chunks": 2, "wall": ttft + 0.1, "max_stall": 0.01, "status": "ok",
                         "error": None, "typed": None})
            recs.append({"kind": "summary", "part": "agents", "system": system, "round": rnd, "position": pos,
                         "argv": [], "env": {}, "error": None,
                         "result": {"chat_ttft_s": ttft, "chat_ok": True, "wall_s": wall, "agents_failed": 0,
                                    "agent_max_stall_s": 0.5 + rnd, "pass": ttft <= 1.0}})
    recs.append({"kind": "end", "loadavg": [0.2, 0.1, 0.1], "ended": "2026-12-07 01:30:00 UTC"})
    return recs


def _write(tmp_path: Path, recs: list[dict[str, Any]], name: str = "qos_agents_20261207T010000Z.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _table(section: str, first: str) -> dict[str, dict[str, str]]:
    """The first table whose header starts ``| first |``: row label -> column -> cell."""
    lines = section.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith(f"| {first} |"))
    cols = [c.strip() for c in lines[at].strip("|").split("|")][1:]
    out = {}
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = dict(zip(cols, cells[1:], strict=True))
    return out


def test_render_is_stable_and_names_its_log_and_key(qos: ModuleType, tmp_path: Path) -> None:
    path = _write(tmp_path, _agents_recs(qos))
    first = qos.render(path)
    assert qos.render(path) == first
    section, key = first
    assert key == "qos agents llamacpp"
    assert f"Generated by `python bench/qos.py --render {path}` from that log." in section
    assert "At `abc1234`" in section and "llama-server version: 1 (abc)" in section


def test_the_peer_with_a_free_slot_sits_beside_ours_without_headers(qos: ModuleType, tmp_path: Path) -> None:
    section, _key = qos.render(_write(tmp_path, _agents_recs(qos)))
    header = next(x for x in section.splitlines() if x.startswith("| agents |"))
    assert header == f"| agents | {NO_HDR} | {NP9} | {HDR} | {NP8} |"
    # the terms: lanes, KV cells, who sends headers, the free slot
    assert "8 lanes x 4096 context; 40960 KV cells for every server" in section
    assert "`superfluid, no headers` and both peer columns send none" in section
    assert "llama-server -np 9 has one slot more than the agents fill: a free slot for the chat" in section
    assert "`--cache-ram 0`" in section and "`--host-cache-mb 0`" in section
    assert "- llama-server -np 9: `LD_LIBRARY_PATH=/b /b/llama-server" in section


def test_cells_are_medians_over_rounds_with_min_max(qos: ModuleType, tmp_path: Path) -> None:
    section, _key = qos.render(_write(tmp_path, _agents_recs(qos)))
    t = _table(section, "agents")
    assert t["chat TTFT s"][HDR] == "0.30 (0.20-0.50)"
    assert t["chat TTFT s"][NO_HDR] == "45.00 (40.00-50.00)"
    assert t["wall s"][NP9] == "100.0 (100.0-104.0)"
    assert t["max agent stall s"][NP8] == "1.50 (0.50-2.50)"
    assert t["agent replies of 64 tokens"][NO_HDR] == "ok: 24 of 24 = 64"
    assert t["rounds measured"][NP9] == "3 of 3"
    assert t["**pass** (chat TTFT ≤ 1 s, no agent failed, no stall over 30 s)"][HDR] == "3 of 3"
    assert t["**pass** (chat TTFT ≤ 1 s, no agent failed, no stall over 30 s)"][NP9] == "**0 of 3**"


def test_ratios_are_per_round_against_the_free_slot_peer(qos: ModuleType, tmp_path: Path) -> None:
    section, _key = qos.render(_write(tmp_path, _agents_recs(qos)))
    assert f"Ratios to {NP9}, per round" in section
    t = _table(section, "ratio")
    # chat TTFT no headers / -np 9 per round: 40/20, 50/25, 45/30 -> 2.0, 2.0, 1.5: median 2.00
    assert t[f"{NO_HDR} / {NP9}"]["chat TTFT"] == "2.00 (3 of 3 rounds)"
    # wall per round: 120/100, 110/100, 130/104 -> 1.2, 1.1, 1.25: median 1.20
    assert t[f"{NO_HDR} / {NP9}"]["wall"] == "1.20 (3 of 3 rounds)"
    # not the ratio of the medians (45/25 = 1.80)
    assert "1.80" not in t[f"{NO_HDR} / {NP9}"]["chat TTFT"]
    assert t[f"{HDR} / {NP9}"]["chat TTFT"] == "0.01 (3 of 3 rounds)"


def test_five_rounds_give_a_95_percent_interval(qos: ModuleType, tmp_path: Path) -> None:
    recs = _agents_recs(qos)
    head = recs[0]
    summaries = [r for r in recs if r["kind"] == "summary"]
    extra = []
    for rnd in (3, 4):  # two more rounds, copies of rounds 0 and 1
        for s in summaries:
            if s["round"] == rnd - 3:
                extra.append({**copy.deepcopy(s), "round": rnd})
    head["rounds"] = 5
    head["orders"] += head["orders"][:2]
    section, _key = qos.render(_write(tmp_path, [*recs[:-1], *extra, recs[-1]]))
    cell = _table(section, "ratio")[f"{NO_HDR} / {NP9}"]["chat TTFT"]
    assert cell.startswith("2.00 (95% CI ") and cell.endswith("(5 of 5 rounds)")
    assert "with its 95% interval" in section


def test_a_short_reply_a_failed_start_and_a_failed_chat_are_shown(qos: ModuleType, tmp_path: Path) -> None:
    recs = _agents_recs(qos)
    short = next(r for r in recs if r["kind"] == "request" and r["system"] == NP9 and r["role"] == "agent")
    short["completion_tokens"] = 63
    for r in recs:
        if r["kind"] == "summary" and r["system"] == NO_HDR and r["round"] == 1:
            r["result"], r["error"] = None, "RuntimeError('superfluid exited early; see /tmp/x.log')"
        if r["kind"] == "summary" and r["system"] == NP8 and r["round"] == 2:
            r["result"]["chat_ttft_s"], r["result"]["chat_ok"] = None, False
        if r["kind"] == "request" and r["system"] == NP8 and r["round"] == 2 and r["role"] == "chat":
            r.update(ttft=None, status="error", error="transport: ReadError('reset')", typed=False)
    recs = [r for r in recs if not (r["kind"] == "request" and r["system"] == NO_HDR and r["round"] == 1)]
    section, _key = qos.render(_write(tmp_path, recs))
    t = _table(section, "agents")
    assert t["agent replies of 64 tokens"][NP9] == "**MISMATCH**: 1 of 24 ≠ 64"
    assert t["rounds measured"][NO_HDR].startswith("**2 of 3** (round 1: `RuntimeError('superfluid exited early")
    assert t["chat TTFT s"][NO_HDR] == "42.50 (40.00-45.00)"          # the two rounds that ran
    assert t["chat TTFT s"][NP8] == "95.00 (90.00-100.00) (**none in 1 of 3 rounds**)"
    assert t["chat ok"][NP8] == "**2 of 3**"
    assert "(2 of 3 rounds)" in _table(section, "ratio")[f"{NO_HDR} / {NP9}"]["chat TTFT"]
    assert f"- {NP8}, chat (untyped): 1 x `transport: ReadError('reset')`" in section


def test_the_keyed_block_is_replaced_and_nothing_else_moves(qos: ModuleType, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    hand = "## QoS (`python bench/qos.py`)\n\n| setup | chat TTFT |\n|---|---|\n| ours | 0.28 s |\n"
    doc.write_text(f"# Benchmarks\n\nIntro.\n\n{hand}")
    path = _write(tmp_path, _agents_recs(qos))
    section, key = qos.render(path)
    begin, end = qos.MARK_BEGIN.format(key=key), qos.MARK_END.format(key=key)
    qos._common.write_doc(doc, section, begin, end)
    once = doc.read_text()
    assert once.count(begin) == 1 and once.endswith(hand)
    # a different part's block sits beside it; rendering the agents block again replaces it alone
    shared_recs = _agents_recs(qos)
    shared_recs[0]["part"] = "shared"
    other, other_key = "## other\n", "qos shared llamacpp"
    qos._common.write_doc(doc, other, qos.MARK_BEGIN.format(key=other_key), qos.MARK_END.format(key=other_key))
    recs = _agents_recs(qos, {**AGENTS, HDR: [(0.9, 119.0), (0.9, 121.0), (0.9, 118.0)]})
    changed = qos.render(_write(tmp_path, recs))[0]
    assert changed != section
    qos._common.write_doc(doc, changed, begin, end)
    text = doc.read_text()
    assert text.count(begin) == 1 and text.count(end) == 1
    assert changed in text and section not in text
    assert other in text and text.endswith(hand)
    qos._common.write_doc(doc, changed, begin, end)
    assert doc.read_text() == text


def test_shared_and_kv_logs_render_their_own_tables(qos: ModuleType, tmp_path: Path) -> None:
    for part, result in (("shared", {"prompt_tokens": 2444, "cached_per_request": [0], "times_prefilled": 1.0,
                                     "prefilled_source": "superfluid_prefill_tokens_total",
                                     "shared_ttft_p50_s": 0.5, "distinct_ttft_p50_s": 4.0, "ttft_ratio": 0.125,
                                     "failures": 0, "pass": True}),
                         ("kv", {"ok": 30, "typed_errors": 2, "untyped": 0, "wall_s": 300.0,
                                 "demand_over_kv_cells": 3.1, "fresh_ok": True, "pass": True})):
        recs = [_header(part, [NO_HDR, NP8], 1, qos)]
        for system in (NP8, NO_HDR):
            recs.append({"kind": "summary", "part": part, "system": system, "round": 0, "position": 0,
                         "argv": [], "env": {}, "error": None, "result": result})
        if part == "kv":
            recs.append({"kind": "request", "part": part, "system": NP8, "round": 0, "role": "kv", "index": 3,
                         "ttft": None, "completion_tokens": None, "prompt_tokens": None, "cached_tokens": None,
                         "prompt_n": None, "chunks": 0, "wall": 1.0, "max_stall": 0.0, "status": "error",
                         "error": {"code": 503, "message": "context | full"}, "typed": True})
        section, key = qos.render(_write(tmp_path, recs, f"qos_{part}.jsonl"))
        assert key == f"qos {part} llamacpp"
        header = next(x for x in section.splitlines() if x.startswith(f"| {part} |"))
        assert header == f"| {part} | {NO_HDR} | {NP8} |"
        assert f"Ratios to {NP8}, per round" in section
        if part == "shared":
            assert _table(section, part)["times shared part prefilled"][NP8] == "1.00"
            assert _table(section, part)["counted from"][NO_HDR] == "superfluid_prefill_tokens_total"
        else:
            assert _table(section, part)["typed errors"][NO_HDR] == "2"
            assert _table(section, part)["fresh request ok"][NP8] == "1 of 1"
            assert f"- {NP8}, kv (typed): 1 x `context / full`" in section


def test_out_names_one_parts_log(qos: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "argv", ["qos.py", "--parts", "agents,kv", "--out", str(tmp_path / "x.jsonl")])
    with pytest.raises(SystemExit) as exc:
        qos.main()
    assert exc.value.code == 2
