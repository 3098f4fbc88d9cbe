"""End to end: the suite CLI against a real daemon on the mock runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from superfluid.suite import SCENARIOS

EIGHT = ("worker_kill", "daemon_restart", "agents_interactive", "kv_exhaustion", "unload_reload", "tool_session",
         "client_disconnect", "shared_prefix")


def _suite(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "superfluid.suite", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_quick_run_passes_all_eight_then_resumes_and_compares(tmp_path: Path) -> None:
    assert tuple(SCENARIOS) == EIGHT
    out = tmp_path / "results"
    proc = _suite("run", "--systems", "superfluid-mock", "--scale", "quick", "--out", str(out), timeout=150.0)
    assert f"SUITE-DONE {out}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    cells = {s: json.loads((out / f"{s}--superfluid-mock.json").read_text()) for s in EIGHT}
    for scenario, cell in cells.items():
        assert cell["scenario"] == scenario and cell["system"] == "superfluid-mock" and cell["scale"] == "quick"
        assert cell["headline"] and cell["condition"]
        assert f"[{scenario} / superfluid-mock] {cell['verdict']}:" in proc.stdout
    # the mock runtime cannot constrain output, so it refuses a forced tool call and calls no tool:
    # tool_session shows nothing about tool calls there (inconclusive, not a pass); all else passes
    tools = cells["tool_session"]
    assert tools["verdict"] == "inconclusive" and tools["numbers"]["forced"] is False, tools["headline"]
    assert "constrained output" in tools["numbers"]["forced_refused"]
    failed = {s: f"{c['verdict']}: {c.get('reason')}" for s, c in cells.items()
              if c["verdict"] != "pass" and s != "tool_session"}
    assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-2000:]
    # every system is judged on the plain pass; our QoS-header pass and resume by id are feature rows
    agents = cells["agents_interactive"]["numbers"]
    assert agents["judged"] == "plain" and agents["agents"] < agents["lanes"] and "qos" in agents["passes"]
    assert cells["agents_interactive"]["features"]["with QoS headers"]["verdict"] == "pass"
    assert cells["daemon_restart"]["features"]["resume by id"]["verdict"] == "pass"
    assert cells["daemon_restart"]["numbers"]["resume"]["session"]
    prefix = cells["shared_prefix"]["numbers"]
    assert prefix["prefilled_source"] == "superfluid_prefill_tokens_total" and prefix["prefix_prefills"] >= 1.0
    kv = cells["kv_exhaustion"]["numbers"]
    assert kv["kv_tokens_source"] == "superfluid_kv_total_tokens" and kv["kv_tokens"] == 6 * kv["ctx"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["scale"] == "quick" and manifest["finished"] and manifest["machine"]["cpus"]
    assert len(manifest["revs"]) == 1 and all(c["rev"] == manifest["revs"][0] for c in cells.values())
    assert not (out / ".suite.lock").exists()

    again = _suite("run", "--systems", "superfluid-mock", "--scale", "quick", "--out", str(out), timeout=60.0)
    assert again.returncode == 0 and again.stdout.count("done before") == len(EIGHT), again.stdout

    report = _suite("compare", str(out), timeout=30.0)
    assert report.returncode == 0
    assert "| scenario | superfluid-mock |" in report.stdout
    assert all(f"## {s}" in report.stdout for s in EIGHT)
    assert f"All 8 cells ran at commit `{manifest['revs'][0]}`" in report.stdout
    assert "| **passes / applicable** (own total) | 7/8 |" in report.stdout
    assert "| fail / inconclusive / error / n/a | 0 / 1 / 0 / 0 |" in report.stdout
    assert "| daemon_restart: resume by id | pass |" in report.stdout
