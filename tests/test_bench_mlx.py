"""bench/mlx_vs_server.py: its table from a synthetic log written here (no servers), and the request
body that makes both servers run every reply to its length (issue #42).

The log has 3 server pairs at 1 and 8 concurrent, 2 rounds a side in each (each pair's rounds +-2%
around its rate), per-pair ratios 1.20 / 1.10 / 1.30 at 1 concurrent and 2.00 / 1.80 / 0.90 at 8,
and one mlx_lm.server reply at 8 concurrent that stopped 3 tokens short (counted by re-tokenizing its
text, as for a server that reports no usage).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 8
PROMPTS = 4
RATES = {1: ((12.0, 10.0), (11.0, 10.0), (13.0, 10.0)), 8: ((40.0, 20.0), (36.0, 20.0), (18.0, 20.0))}


@pytest.fixture(scope="module")
def mv() -> ModuleType:
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location("_bench_mlx_vs_server_test", ROOT / "bench/mlx_vs_server.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic(mv: ModuleType, path: Path) -> Path:
    ours, theirs = mv.OURS, mv.THEIRS
    recs: list[dict[str, Any]] = [{
        "kind": "header", "commit": "abc1234",
        "args": {"model": "/models/SmolLM2-135M-Instruct-mlx", "variant": "f32", "pairs": 3, "rounds": 2,
                 "tokens": TOKENS, "lanes": 8, "prompts": PROMPTS, "concurrency": "1,8", "order_seed": None,
                 "allow_busy": False, "blas": "/usr/lib/libopenblas.so.0"},
        "started": "2026-12-07 00:00:00 UTC", "cpu": "Synthetic CPU (2 cores)", "loadavg": 0.1,
        "machine": {"cores": 2, "mem_gib": 7.7, "kernel": "6.1.0", "thp": "madvise", "thp_defrag": "madvise",
                    "loadavg": [0.1, 0.1, 0.1]},
        "versions": {"superfluid": "abc1234", "mlx": "0.32.4", "mlx_lm": "0.32.2", "transformers": "4.57.0",
                     "python": "3.11.2"},
        "sides": [ours, theirs], "concurrency": [1, 8], "prompts": [f"p{i}" for i in range(PROMPTS)],
        "body": {"max_tokens": TOKENS, "temperature": 0, "logit_bias": {"0": -100, "2": -100}, "ignore_eos": True},
        "stop_ids": {"0": "<|endoftext|>", "2": "<|im_end|>"},
        "servers": {ours: {"model": "/models/SmolLM2-135M-Instruct-mlx",
                           "env": {"PYTHONPATH": "/repo", "SUPERFLUID_MLX_CPU_WEIGHTS": "f32"}, "argv": ["superfluid"]},
                    theirs: {"model": "/cache/mlx-f32/SmolLM2-135M-Instruct-mlx",
                             "env": {"LD_PRELOAD": "/usr/lib/libopenblas.so.0"}, "argv": ["mlx_lm.server"]}},
        "inherited": {}}]
    for pair in range(3):
        for conc, rates in RATES.items():
            for rnd in range(2):
                for pos, side in enumerate(mv.round_order(mv.SIDES, pair, rnd, None)):
                    rate = rates[pair][0 if side == ours else 1] * (1.02 if rnd == 0 else 0.98)
                    total = 0
                    for prompt in range(PROMPTS):
                        short = conc == 8 and side == theirs and pair == 1 and rnd == 0 and prompt == 2
                        n = TOKENS - 3 if short else TOKENS
                        total += n
                        recs.append({"kind": "request", "pair": pair, "conc": conc, "side": side, "round": rnd,
                                     "prompt": prompt, "completion_tokens": n,
                                     "counted": "retokenized" if short else "usage", "chunks": n, "ttft": 0.05,
                                     "wall": 0.5})
                    recs.append({"kind": "round", "pair": pair, "conc": conc, "side": side, "round": rnd,
                                 "position": pos, "tokens": total, "wall": total / rate, "tok_s": rate})
        recs.append({"kind": "pair", "pair": pair, "servers": {}})
    recs.append({"kind": "end", "loadavg": [0.2, 0.1, 0.1], "ended": "2026-12-07 01:00:00 UTC"})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _row(section: str, conc: int) -> list[str]:
    for line in section.splitlines():
        if line.startswith(f"| {conc} |") and "tok/s" not in line:
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row for {conc} concurrent")


def test_a_pairs_ratio_is_its_sides_median_rounds_from_that_pair(mv: ModuleType, tmp_path: Path) -> None:
    recs = [json.loads(x) for x in synthetic(mv, tmp_path / "log.jsonl").read_text().splitlines()]
    assert mv.pair_ratios(recs, 1, mv.OURS, mv.THEIRS) == pytest.approx([1.2, 1.1, 1.3])
    assert mv.pair_ratios(recs, 8, mv.OURS, mv.THEIRS) == pytest.approx([2.0, 1.8, 0.9])


def test_the_table_has_both_sides_the_interval_over_pairs_and_tokens_per_request(mv: ModuleType,
                                                                                  tmp_path: Path) -> None:
    section, key = mv.render(synthetic(mv, tmp_path / "log.jsonl"))
    assert key == "mlx SmolLM2-135M-Instruct-mlx f32"
    one = _row(section, 1)
    assert (one[1], one[2]) == ("12.0", "10.0")           # medians over pairs of each side's pair rate
    assert one[3] == "1.200"                               # the median of the pairs' ratios
    logs = [math.log(r) for r in (1.2, 1.1, 1.3)]
    mean = sum(logs) / 3
    half = 4.303 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    assert one[4] == f"{math.exp(mean):.3f} ({math.exp(mean - half):.3f}-{math.exp(mean + half):.3f})"
    assert one[5] == "0 of 3"
    assert (one[6], one[7]) == ("8", "8")
    assert one[8] == f"ok: {3 * 2 * 2 * PROMPTS} of {3 * 2 * 2 * PROMPTS} = 8"
    assert "2 degrees of freedom" in section


def test_a_short_reply_is_flagged_never_hidden(mv: ModuleType, tmp_path: Path) -> None:
    section, _key = mv.render(synthetic(mv, tmp_path / "log.jsonl"))
    eight = _row(section, 8)
    assert eight[5] == "1 of 3"
    assert eight[6] == "8"
    assert eight[7] == "5-8 (median 8)"
    assert eight[8] == f"**MISMATCH**: mlx_lm.server 1 of {3 * 2 * PROMPTS} ≠ 8"
    n = 3 * 2 * 2 * PROMPTS
    assert f"superfluid-mlx: {n} from usage, 0 re-tokenized; mlx_lm.server: {n - 1} from usage, 1 re-tokenized" in section


def test_render_is_a_pure_function_of_the_log_and_writes_a_keyed_block(mv: ModuleType, tmp_path: Path) -> None:
    log = synthetic(mv, tmp_path / "log.jsonl")
    first = mv.render(log)
    assert mv.render(log) == first
    section, key = first
    assert f"Generated by `python bench/mlx_vs_server.py --render {log}`" in section
    assert "mlx 0.32.4, mlx-lm 0.32.2" in section
    assert "`logit_bias` -100 on every id either side ends a reply on (0 `<|endoftext|>`, 2 `<|im_end|>`)" in section
    assert "`SUPERFLUID_MLX_CPU_WEIGHTS=f32`" in section and "`LD_PRELOAD=/usr/lib/libopenblas.so.0`" in section
    doc = tmp_path / "page.md"
    doc.write_text("# Benchmarks\n\nIntro.\n\n## Older, hand-written\n\n| a |\n|---|\n| 1 |\n")
    for _ in range(2):  # a second render replaces the block, not adds one
        mv._common.write_doc(doc, section, mv.MARK_BEGIN.format(key=key), mv.MARK_END.format(key=key))
    text = doc.read_text()
    assert text.count(mv.MARK_BEGIN.format(key=key)) == 1 and "## Older, hand-written" in text
    # the form tests/test_docs_generated.py finds and checks
    block = re.search(r"<!-- (?P<gen>bench/[\w.-]+\.py)(?P<key>[^:>]*): begin \(generated by [^\n]*?\) -->\n"
                      r"(?P<body>.*?)<!-- (?P=gen)(?P=key): end -->", text, re.S)
    assert block and block["gen"] == "bench/mlx_vs_server.py" and block["key"] == f" {key}"
    assert block["body"] == section


class _FakeTokenizer:
    eos_token_ids = {2, 7}
    eos_token = "<|im_end|>"

    def get_vocab(self) -> dict[str, int]:
        return {"<|endoftext|>": 0, "a": 1, "<|im_end|>": 2, "<end_of_turn>": 9}


def test_the_body_bans_every_stop_id_of_either_side(mv: ModuleType) -> None:
    ids = mv.stop_ids(_FakeTokenizer())
    assert ids == [0, 2, 7, 9]   # mlx-lm's eos ids and the end-of-turn names our runtime stops on
    assert mv.request_fields(ids) == {"temperature": 0, "logit_bias": {"0": -100, "2": -100, "7": -100, "9": -100}}


def test_our_endpoint_takes_the_same_logit_bias(mv: ModuleType) -> None:
    from superfluid.api._params import sampling_from

    body = mv.request_fields([0, 2])
    s = sampling_from(body, n_vocab=10)
    assert s.logit_bias == ((0, -100.0), (2, -100.0)) and s.temperature == 0


def _tokenizer_dir(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "<|im_end|>": 2, "hello": 3, "world": 4, "<eos_b>": 5, "<eos_c>": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|im_end|>", "unk_token": "<unk>"}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 5}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    return path


def test_the_body_names_the_eos_ids_mlx_lm_server_stops_on(mv: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("mlx_lm")
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.sample_utils import make_logits_processors

    tok = mv.load_tokenizer(str(_tokenizer_dir(tmp_path)))
    assert set(tok.eos_token_ids) == {2, 5, 6}   # the tokenizer's EOS and the generation config's
    ids = mv.stop_ids(tok)
    assert ids == [1, 2, 5, 6]                    # and <|endoftext|>, which our runtime stops on
    bias = mv.request_fields(ids)["logit_bias"]
    assert {str(i) for i in tok.eos_token_ids} <= set(bias)
    # as mlx_lm.server applies it (its request parsing: int keys, float values): never the argmax
    (process,) = make_logits_processors({int(k): float(v) for k, v in bias.items()})
    logits = mx.array([[0.0, 40.0, 50.0, 1.0, 2.0, 60.0, 30.0]])
    assert int(mx.argmax(process(mx.array([3]), logits), axis=-1).item()) == 4
    # a reply without usage is counted by re-tokenizing its text
    assert mv.count({"usage": None, "text": "hello world hello"}, tok) == (3, "retokenized")
    assert mv.count({"usage": {"completion_tokens": 8}, "text": "x"}, tok) == (8, "usage")


def test_the_smollm2_mlx_directorys_stop_ids(mv: ModuleType) -> None:
    pytest.importorskip("mlx_lm")
    from superfluid.models._mlx_convert import mlx_test_model_path

    try:
        model = mlx_test_model_path(build=False)
    except FileNotFoundError:
        pytest.skip("the MLX test directory is not built")
    tok = mv.load_tokenizer(str(model))
    ids = mv.stop_ids(tok)
    assert set(tok.eos_token_ids) <= set(ids)
    assert set(mv.request_fields(ids)["logit_bias"]) == {str(i) for i in ids}
