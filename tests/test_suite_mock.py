"""End to end: the suite CLI against a real daemon on the mock runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCENARIOS = ("client_disconnect", "worker_kill")


def _suite(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "superfluid.suite", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_quick_run_writes_cells_manifest_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _suite("run", "--systems", "superfluid-mock", "--scale", "quick", "--scenarios", ",".join(SCENARIOS),
                  "--out", str(out))
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert f"SUITE-DONE {out}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    for scenario in SCENARIOS:
        cell = json.loads((out / f"{scenario}--superfluid-mock.json").read_text())
        assert cell["verdict"] in ("pass", "fail", "unsupported", "error")
        assert cell["scenario"] == scenario and cell["system"] == "superfluid-mock" and cell["scale"] == "quick"
        assert cell["headline"] and cell["condition"]
        if cell["verdict"] != "pass":
            assert cell["reason"] and "\n" not in cell["reason"]
        assert f"[{scenario} / superfluid-mock] {cell['verdict']}:" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["scale"] == "quick" and manifest["finished"] and manifest["machine"]["cpus"]
    assert not (out / ".suite.lock").exists()

    again = _suite("run", "--systems", "superfluid-mock", "--scale", "quick", "--scenarios", ",".join(SCENARIOS),
                   "--out", str(out), timeout=60.0)
    assert again.stdout.count("done before") == len(SCENARIOS), again.stdout

    report = _suite("compare", str(out), timeout=30.0)
    assert report.returncode == 0
    assert "| scenario | superfluid-mock |" in report.stdout
    assert all(f"## {s}" in report.stdout for s in SCENARIOS)
