"""bench/determinism_cost.py's table from a small synthetic log the test writes: no servers (issue #42).

The log has 3 daemon pairs, 2 rounds a side per measure in each (each pair's rounds +-2% around its
value): prefill at 2,000 tokens with per-pair ratios 1.20 / 1.30 / 1.25, the follow-up turn 1.50 /
1.40 / 0.95, decode at 1 lane 0.90 / 0.95 / 1.02 and at 8 lanes 0.80 / 0.85 / 0.82.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

BASE = {"prefill:2000": [1.0, 1.1, 0.9], "follow:2000": [0.20, 0.25, 0.30], "decode:1": [100.0, 102.0, 98.0],
        "decode:8": [300.0, 310.0, 290.0]}
RATIOS = {"prefill:2000": [1.20, 1.30, 1.25], "follow:2000": [1.50, 1.40, 0.95], "decode:1": [0.90, 0.95, 1.02],
          "decode:8": [0.80, 0.85, 0.82]}


@pytest.fixture(scope="module")
def dc() -> ModuleType:
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location("_bench_determinism_cost_test", ROOT / "bench/determinism_cost.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _argv(side: str, runtime: str) -> list[str]:
    argv = ["/venv/bin/python", "-m", "superfluid", "serve", "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "--http",
            "127.0.0.1:0", "--no-tui", "--log-level", "WARNING", "--host-cache-mb", "2048", "--max-batch", "8",
            "--max-context", "3072", "--threads", "2", "--sessions", "<a fresh directory per pair>"]
    if runtime == "mlx":
        argv += ["--runtime", "mlx"]
    return argv + (["--deterministic"] if side == "deterministic" else [])


def write_log(path: Path, *, pairs: int = 3, runtime: str = "llamacpp", short: int | None = None,
              model: str = "/models/SmolLM2-135M-Instruct.Q4_1.gguf", too_long: bool = False) -> Path:
    """A log as the bench writes it; ``short``: one deterministic decode reply that many tokens;
    ``too_long``: a 12,000-token length asked for too, left out (over an 8,192-token context)."""
    recs: list[dict[str, Any]] = [{
        "kind": "header", "commit": "abc1234", "started": "2026-12-07 03:00:00 UTC", "cpu": "Test CPU (2 cores)",
        "loadavg": 0.1,
        "args": {"runtime": runtime, "model": model, "pairs": pairs, "rounds": 2, "lengths": "2000", "lanes": "1,8",
                 "tokens": 128, "turn_tokens": 64, "threads": 2, "host_cache_mb": 2048, "allow_busy": False},
        "machine": {"cores": 2, "mem_gib": 23.5, "kernel": "6.1", "thp": "always [madvise] never"},
        "versions": {"superfluid": "abc1234", "llama_cpp_python": "0.3.36", "python": "3.11.7",
                     **({"mlx": "0.32.4", "mlx-lm": "0.32.2"} if runtime == "mlx" else {})},
        "sides": ["default", "deterministic"], "lengths": [2000, *([12000] if too_long else [])], "lanes": [1, 8], "turn_tokens": 64,
        "decode_prompts": [f"q{i}" for i in range(8)], "sampling": {"temperature": 0}, "max_context": 3072,
        "daemons": {s: {"argv": _argv(s, runtime), "env": {}} for s in ("default", "deterministic")}}]
    for p in range(pairs):
        for measure, base in BASE.items():
            decode = measure.startswith("decode")
            for rnd, wiggle in enumerate((0.98, 1.02)):
                order = ["default", "deterministic"] if (p + rnd) % 2 == 0 else ["deterministic", "default"]
                for pos, side in enumerate(order):
                    value = base[p] * wiggle * (RATIOS[measure][p] if side == "deterministic" else 1.0)
                    n = 8 if decode else 1
                    for i in range(n):
                        tokens = 128 if decode else 64
                        if short is not None and decode and side == "deterministic" and (p, rnd, i) == (0, 0, 0):
                            tokens = short
                        recs.append({"kind": "request", "pair": p, "measure": measure, "side": side, "round": rnd,
                                     "turn": 2 if measure.startswith("follow") else 1,
                                     "prompt_tokens": 2000 if measure.startswith("prefill") else
                                     (2090 if measure.startswith("follow") else 12),
                                     "cached_tokens": (2048 if side == "default" else 1984)
                                     if measure.startswith("follow") else 0,
                                     "completion_tokens": tokens, "chunks": tokens, "ttft": 0.01 if decode else value,
                                     "wall": 1.0})
                    recs.append({"kind": "round", "pair": p, "measure": measure, "side": side, "round": rnd,
                                 "position": pos, "value": value})
        recs.append({"kind": "pair", "pair": p, "frame_tokens": {"default": 60, "deterministic": 60},
                     "context": {"default": 8192, "deterministic": 8192}, "left_out": [12000] if too_long else [],
                     "daemons": {s: {"argv": _argv(s, runtime)} for s in ("default", "deterministic")}})
    recs.append({"kind": "end", "loadavg": [0.2, 0.2, 0.2], "ended": "2026-12-07 04:00:00 UTC"})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _row(section: str, starts: str) -> list[str]:
    for line in section.splitlines():
        if line.startswith(f"| {starts}"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row starting {starts!r}")


def test_a_pairs_ratio_is_its_sides_median_rounds_from_that_pair(dc: ModuleType, tmp_path: Path) -> None:
    recs = [json.loads(x) for x in write_log(tmp_path / "d.jsonl").read_text().splitlines()]
    for measure, want in RATIOS.items():
        assert dc.pair_ratios(recs, measure) == pytest.approx(want)


def test_the_ratio_is_the_median_over_pairs_with_a_t_interval_over_pairs(dc: ModuleType, tmp_path: Path) -> None:
    section, _key = dc.render(write_log(tmp_path / "d.jsonl"))
    ratios = RATIOS["prefill:2000"]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 3
    half = 4.303 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)  # t(0.975, 2 df)
    row = _row(section, "prefill, 2,000-token")
    assert row[0] == "prefill, 2,000-token conversation (2,000 prompt tokens): time to first token, s"
    assert row[1] == "1.00" and row[2] == "1.20"             # each side's median over pairs of its pair values
    assert row[3] == (f"1.250; geometric mean {math.exp(mean):.3f} "
                      f"(95% {math.exp(mean - half):.3f}-{math.exp(mean + half):.3f})")
    assert (row[4], row[5]) == ("3", "3 of 3")
    assert "2 degrees of freedom" in section
    assert "best-of" not in section.replace("No best-of-N", "")


def test_slower_counts_follow_each_measures_direction(dc: ModuleType, tmp_path: Path) -> None:
    section, _key = dc.render(write_log(tmp_path / "d.jsonl"))
    follow = _row(section, "follow-up turn")
    assert follow[0] == ("follow-up turn on the 2,000-token conversation (2,090 prompt tokens; cached: default "
                         "2,048, --deterministic 1,984): time to first token, s")
    assert follow[5] == "2 of 3"                              # times: slower above 1
    one, eight = _row(section, "decode, 1 lane"), _row(section, "decode, 8 lanes")
    assert one[1] == "100.0" and one[3].startswith("0.950;")
    assert one[5] == "2 of 3"                                 # tok/s: slower below 1
    assert eight[5] == "3 of 3"
    rows = [line.split("|")[1].strip() for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| measure")]
    assert [r.split(" ")[0].rstrip(",") for r in rows] == ["prefill", "follow-up", "decode", "decode"]


def test_one_pair_has_no_interval(dc: ModuleType, tmp_path: Path) -> None:
    section, _key = dc.render(write_log(tmp_path / "d.jsonl", pairs=1))
    assert _row(section, "decode, 8 lanes")[3] == "0.800 (one pair: no interval)"
    assert "1 fresh daemon pair, " in section


def test_a_short_reply_is_flagged(dc: ModuleType, tmp_path: Path) -> None:
    assert "Every reply had the tokens asked for (" in dc.render(write_log(tmp_path / "ok.jsonl"))[0]
    section, _key = dc.render(write_log(tmp_path / "short.jsonl", short=127))
    assert "**MISMATCH**: default 0 of" in section and "deterministic 2 of 108" in section


def test_render_is_a_pure_function_of_the_log_and_names_it(dc: ModuleType, tmp_path: Path) -> None:
    log = write_log(tmp_path / "determinism_x.jsonl")
    first = dc.render(log)
    assert dc.render(log) == first
    section, key = first
    assert key == "llamacpp SmolLM2-135M-Instruct.Q4_1.gguf"
    assert f"Generated by `python bench/determinism_cost.py --render {log}` from that log." in section
    assert "At `abc1234`" in section and "(determinism_x.jsonl)" in section
    # the daemons' shared command line, without the per-pair address and sessions directory
    assert ("`superfluid serve SmolLM2-135M-Instruct.Q4_1.gguf --no-tui --log-level WARNING --host-cache-mb 2048 "
            "--max-batch 8 --max-context 3072 --threads 2`") in section
    mlx = dc.render(write_log(tmp_path / "m.jsonl", runtime="mlx", model="/m/SmolLM2-135M-Instruct-mlx"))
    assert mlx[1] == "mlx SmolLM2-135M-Instruct-mlx"
    assert "MLX, SmolLM2-135M-Instruct-mlx" in mlx[0] and "mlx 0.32.4, mlx-lm 0.32.2" in mlx[0]


def test_the_block_is_keyed_by_runtime_and_model_and_replaced_in_place(dc: ModuleType, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "benchmarks.md"
    hand = "### Determinism mode's cost (hand-written)\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    doc.write_text(f"# Benchmarks\n\nPreamble.\n\n## Older\n\n{hand}")

    def run(log: Path) -> None:
        monkeypatch.setattr(sys, "argv", ["determinism_cost.py", "--render", str(log), "--doc", str(doc)])
        assert dc.main() == 0

    llama = write_log(tmp_path / "a.jsonl")
    mlx = write_log(tmp_path / "b.jsonl", runtime="mlx", model="/m/SmolLM2-135M-Instruct-mlx")
    run(llama)
    run(mlx)
    once = doc.read_text()
    run(write_log(tmp_path / "a.jsonl", pairs=1))  # the same key again: replaced, not added
    text = doc.read_text()
    for key in ("llamacpp SmolLM2-135M-Instruct.Q4_1.gguf", "mlx SmolLM2-135M-Instruct-mlx"):
        assert text.count(dc.MARK_BEGIN.format(key=key)) == 1
        assert text.count(dc.MARK_END.format(key=key)) == 1
    assert hand in text and text.startswith("# Benchmarks\n\nPreamble.\n\n")
    assert text != once and "1 fresh daemon pair, " in text
    block = text.split(dc.MARK_BEGIN.format(key="llamacpp SmolLM2-135M-Instruct.Q4_1.gguf") + "\n")[1]
    assert block.split(dc.MARK_END.format(key="llamacpp SmolLM2-135M-Instruct.Q4_1.gguf"))[0] == dc.render(llama)[0]
    # the docs check's pattern finds both blocks, and each names one log
    from tests.test_docs_generated import BLOCK, RENDERED_FROM

    found = list(BLOCK.finditer(text))
    assert sorted(m["key"].strip() for m in found) == ["llamacpp SmolLM2-135M-Instruct.Q4_1.gguf",
                                                       "mlx SmolLM2-135M-Instruct-mlx"]
    assert all(len(RENDERED_FROM.findall(m["body"])) == 1 for m in found)


def test_a_length_over_the_served_context_is_a_row_that_says_so(dc: ModuleType, tmp_path: Path) -> None:
    section, _key = dc.render(write_log(tmp_path / "d.jsonl", too_long=True))
    prefill = _row(section, "prefill, 12,000-token")
    assert prefill == ["prefill, 12,000-token conversation (not measured: over the served 8,192-token context)",
                       "—", "—", "—", "0", "0 of 0"]
    assert _row(section, "follow-up turn on the 12,000")[0].endswith("(not measured: over the served 8,192-token "
                                                                     "context)")
    assert _row(section, "prefill, 2,000-token")[4] == "3"
    assert dc.fits(8000, 64, 8192) and not dc.fits(8100, 64, 8192)


def test_sides_alternate_a_b_b_a(dc: ModuleType) -> None:
    first = [[dc.round_order(dc.SIDES, p, r, None)[0] for r in range(4)] for p in (0, 1)]
    assert first == [["default", "deterministic"] * 2, ["deterministic", "default"] * 2]


def test_the_context_holds_the_longest_conversation(dc: ModuleType) -> None:
    assert dc.context_for([2000, 6000, 12000], 64) == 12288
    assert dc.context_for([12200], 64) == 13312
    assert dc.prompt_seed(0, 1, 2) != dc.prompt_seed(1, 0, 2) != dc.prompt_seed(0, 0, 2)
