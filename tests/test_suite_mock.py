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
    failed = {s: f"{c['verdict']}: {c.get('reason')}" for s, c in cells.items() if c["verdict"] != "pass"}
    assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["scale"] == "quick" and manifest["finished"] and manifest["machine"]["cpus"]
    assert not (out / ".suite.lock").exists()

    again = _suite("run", "--systems", "superfluid-mock", "--scale", "quick", "--out", str(out), timeout=60.0)
    assert again.returncode == 0 and again.stdout.count("done before") == len(EIGHT), again.stdout

    report = _suite("compare", str(out), timeout=30.0)
    assert report.returncode == 0
    assert "| scenario | superfluid-mock |" in report.stdout
    assert all(f"## {s}" in report.stdout for s in EIGHT)
