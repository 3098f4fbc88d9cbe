"""The MLX runtime (mlx-lm on the CPU device here) and the baseRT loader.

Real tests use the MLX directory ``python -m superfluid.models --mlx`` builds
from the embedded SmolLM2 GGUF (``real(MLX_DIR)``); they are kept to a few
tokens (MLX on this class of machine decodes SmolLM2 at 1-10 tokens/s under load).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from superfluid.serving import ModelSource, ServeConfig
from superfluid.models._files import is_basert_bundle, is_mlx_dir, model_name, resolve_runtime
from superfluid.proto import Admit, Sampling
from superfluid.sched import PlannerConfig
from superfluid.suite._client import metric_sum

from .conftest import MLX_DIR, REAL_GGUF, open_daemon, sse_events, stream_text, worker_pids

FAKE_LIB_SRC = Path(__file__).parent / "fixtures" / "fake_basert.c"
ROOT = Path(__file__).resolve().parent.parent


# -- detection and refusals (no model needed) ----------------------------------------


def test_runtime_detection(tmp_path: Path) -> None:
    mlx_dir = tmp_path / "m"
    mlx_dir.mkdir()
    (mlx_dir / "config.json").write_text("{}")
    assert not is_mlx_dir(str(mlx_dir))          # no weights yet
    (mlx_dir / "model.safetensors").write_bytes(b"")
    assert resolve_runtime(str(mlx_dir), None) == "mlx"
    bundle = tmp_path / "q.base"
    bundle.write_bytes(b"BASE\x01")
    magic_only = tmp_path / "weights.bin"
    magic_only.write_bytes(b"BASE\x01")
    gguf = tmp_path / "x.bin"
    gguf.write_bytes(b"GGUF")
    assert resolve_runtime(str(bundle), None) == "basert" and model_name(str(bundle), "basert") == "q"
    assert is_basert_bundle(str(magic_only)) and resolve_runtime(str(magic_only), None) == "basert"
    assert resolve_runtime(str(gguf), None) == "llamacpp"
    assert resolve_runtime(str(bundle), "native") == "basert"


def test_serve_base_without_library_refuses_in_one_line(tmp_path: Path) -> None:
    bundle = tmp_path / "model.base"
    bundle.write_bytes(b"BASE\x01")
    env = {k: v for k, v in os.environ.items() if k != "BASERT_LIB"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "superfluid", "serve", str(bundle), "--port", "0",
                           "--sessions", str(tmp_path / "s")], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2  # the runtime registry's refusal: not installed here (no libbasert)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "BASERT_LIB" in lines[0] and "runtime install basert" in lines[0], proc.stderr


def test_mlx_dir_with_python_code_is_refused_unless_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from superfluid.worker._mlx import check_model_dir

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "modeling_evil.py").write_text("raise SystemExit")
    monkeypatch.delenv("SUPERFLUID_MLX_TRUST_MODEL_CODE", raising=False)
    with pytest.raises(PermissionError, match="modeling_evil.py.*SUPERFLUID_MLX_TRUST_MODEL_CODE=1"):
        check_model_dir(str(tmp_path))
    monkeypatch.setenv("SUPERFLUID_MLX_TRUST_MODEL_CODE", "1")
    assert check_model_dir(str(tmp_path))["model_type"] == "llama"


def test_mlx_memory_fit_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from superfluid.worker._mlx import MemoryFitError, check_model_dir

    (tmp_path / "config.json").write_text("{}")
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(1 << 42)   # a sparse 4 TiB "weights" file
    monkeypatch.delenv("SUPERFLUID_MLX_SKIP_FIT_CHECK", raising=False)
    with pytest.raises(MemoryFitError, match="4096.0 GiB"):
        check_model_dir(str(tmp_path))
    monkeypatch.setenv("SUPERFLUID_MLX_SKIP_FIT_CHECK", "1")
    check_model_dir(str(tmp_path))


# -- the baseRT binding layer against a compiled fake library -------------------------


def build_fake(out: Path, *defines: str) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "gcc is needed to build the fake libbasert"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", *defines, "-o", str(out), str(FAKE_LIB_SRC)],
                   check=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def fake_basert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake(tmp_path_factory.mktemp("basert") / "libbasert.so")


def test_basert_binding_drives_the_executor(fake_basert: Path, tmp_path: Path) -> None:
    from superfluid.worker._basert import load_basert
    from superfluid.worker._executor import Executor

    bundle = tmp_path / "toy.base"
    bundle.write_bytes(b"BASE\x01")
    engine = load_basert(str(bundle), max_batch=2, max_context=256, lib=str(fake_basert))
    try:
        assert engine.info.n_vocab == 257 and engine.info.name == "toy"
        assert engine.tokenize("abc", add_special=False, parse_special=False) == [97, 98, 99]
        assert engine.piece(120) == b"x" and engine.piece(256) == b""
        ex = Executor(engine, max_lanes=2)
        prompt = engine.tokenize("hello a", add_special=False, parse_special=False)
        ex.admit(Admit(lane=1, tokens=prompt, n_prompt=len(prompt), max_new=4, sampling=Sampling()))
        pieces = []
        for _ in range(8):
            for row in ex.step(prefill_budget=64).emits:
                pieces.append(row[2])
        assert b"".join(pieces) == b"bcde"     # each next byte is the last one + 1
        # the same prompt again reuses the cached sequence (positions checked by the library)
        ex.admit(Admit(lane=2, tokens=prompt, n_prompt=len(prompt), max_new=2, sampling=Sampling()))
        assert ex.lanes[2].cached == len(prompt) - 1
    finally:
        engine.close()


def test_basert_refuses_a_bundle_without_magic_and_a_missing_library(fake_basert: Path, tmp_path: Path) -> None:
    from superfluid.worker._basert import BaseRTMissing, load_basert

    bad = tmp_path / "bad.base"
    bad.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="bad magic"):
        load_basert(str(bad), max_batch=1, max_context=64, lib=str(fake_basert))
    with pytest.raises(BaseRTMissing, match="--basert-lib"):
        load_basert(str(bad), max_batch=1, max_context=64, lib=str(tmp_path / "nope.so"))
    other_abi = build_fake(tmp_path / "libbasert2.so", "-DFAKE_ABI=2")
    with pytest.raises(BaseRTMissing, match="ABI 2"):
        load_basert(str(bad), max_batch=1, max_context=64, lib=str(other_abi))


# -- the real MLX runtime --------------------------------------------------------------

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList three colors.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
]
AGREE = 8


@pytest.mark.real(MLX_DIR, REAL_GGUF)
def test_mlx_greedy_agrees_with_llamacpp() -> None:
    """Same weights (bit for bit: Q4_1 groups are MLX 4-bit groups), same tokenizer:
    greedy output agrees for the first ``AGREE`` tokens on these prompts (32-token runs
    measured agree for 8, 32, 12 (both ended), 4, 13 and 22 tokens on six prompts: llama.cpp
    quantizes activations to 8 bits for its Q4_1 dot products and MLX does not, so where
    two candidates are within ~0.2 logits of each other the two runtimes may pick differently)."""
    import llama_cpp

    from superfluid.worker._executor import Executor
    from superfluid.worker._mlx import MlxEngine

    llm = llama_cpp.Llama(str(REAL_GGUF), n_ctx=256, verbose=False, n_threads=2)
    engine = MlxEngine(str(MLX_DIR), max_batch=1, max_context=256)
    ex = Executor(engine, max_lanes=1)   # one executor: later prompts reuse or trim the cached KV
    try:
        for lane, text in enumerate(PROMPTS):
            ids = llm.tokenize(text.encode(), add_bos=False, special=True)
            assert engine.tokenize(text, add_special=False, parse_special=True) == ids
            llm.reset()
            ref = []
            for tok in llm.generate(ids, temp=0.0, top_k=1):
                ref.append(tok)
                if len(ref) == AGREE or llm.token_eos() == tok:
                    break
            ex.admit(Admit(lane=lane, tokens=ids, n_prompt=len(ids), max_new=AGREE, sampling=Sampling()))
            got = []
            while ex.lanes:
                got += [row[1] for row in ex.step(prefill_budget=512).emits]
            assert got == ref, (text, got, ref)
    finally:
        ex.close()
        engine.close()
        llm.close()


def mlx_config(*, max_batch: int = 2, deterministic: bool = False) -> ServeConfig:
    return ServeConfig(models=(ModelSource(spec=str(MLX_DIR), runtime="mlx", name="smol-mlx"),), port=0,
                       max_batch=max_batch, max_context=1024, planner=PlannerConfig(max_batch=max_batch),
                       hang_timeout_s=300.0, deterministic=deterministic)


@pytest.mark.real(MLX_DIR)
async def test_mlx_serves_every_dialect() -> None:
    import anthropic
    import ollama
    import openai

    async with open_daemon(mlx_config()) as d:
        models = (await d.client.get("/v1/models")).json()["data"]
        assert models[0]["runtime"]["id"] == "mlx"
        assert models[0]["capabilities"]["grammar"] is True
        oa = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="x", timeout=300)
        stream = await oa.chat.completions.create(
            model="smol-mlx", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=6, temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text.startswith("The capital of France"), text
        # constrained output through llguidance: a schema-valid document, and a forced tool call that
        # max_tokens cuts is closed to a valid call (the truncation recovery of llama.cpp's route)
        done = await oa.chat.completions.create(
            model="smol-mlx", messages=[{"role": "user", "content": "Weather in Paris, in celsius, as JSON."}],
            max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": GRAMMAR_SCHEMA}})
        doc = json.loads(done.choices[0].message.content or "")
        assert set(doc) == {"city", "units"} and doc["units"] in ("celsius", "fahrenheit"), doc
        cut = await oa.chat.completions.create(
            model="smol-mlx", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            max_tokens=4, temperature=0, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": GRAMMAR_SCHEMA}}])
        (call,) = cut.choices[0].message.tool_calls or ()
        assert cut.choices[0].finish_reason == "length" and call.function.name == "get_weather", cut
        assert set(json.loads(call.function.arguments)) == {"city", "units"}, call
        an = anthropic.AsyncAnthropic(base_url=d.url, api_key="x", timeout=300)
        msg = await an.messages.create(model="smol-mlx", max_tokens=4, extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert msg.content[0].text.startswith("The capital"), msg
        ol = ollama.AsyncClient(host=d.url, timeout=300)
        reply = await ol.chat(model="smol-mlx", messages=[{"role": "user", "content": "List three colors."}],
                              options={"num_predict": 3, "temperature": 0})
        assert reply.message.content.startswith("1."), reply


@pytest.mark.real(MLX_DIR)
async def test_mlx_worker_kill_mid_stream_continues() -> None:
    body = {"model": "smol-mlx", "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    # deterministic: the respawned worker replays the committed tokens one per decode round, as they
    # were first computed; without it they are re-prefilled in one pass, which rounds differently, and
    # the rest is only a valid continuation (SPEC.md §5 "Determinism"), not the reference's text
    async with open_daemon(mlx_config(max_batch=1, deterministic=True)) as d:
        async with d.client.stream("POST", "/v1/chat/completions", json=body, timeout=600) as r:
            ref = stream_text(await sse_events(r))
        killed = False
        async with d.client.stream("POST", "/v1/chat/completions", json=body, timeout=600) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: {") and not killed and '"content":"' in line and len(events) >= 3:
                    for pid in worker_pids("mlx"):
                        os.kill(pid, signal.SIGKILL)
                    killed = True
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        assert killed
        assert not any("error" in e for e in events), events[-1]
        assert stream_text(events) == ref
        with trio.fail_after(5):
            metrics = (await d.client.get("/metrics")).text
        assert metric_sum(metrics, "superfluid_worker_respawns_total") == 1


_WEIGHTS_PROBE = """
import json, sys
from superfluid.worker._engine import BatchRow
from superfluid.worker._mlx import MlxEngine
e = MlxEngine(sys.argv[1], max_batch=1, max_context=256)
toks = e.tokenize("The capital of France is", add_special=False, parse_special=False)
out, pos = [], 0
for _ in range(int(sys.argv[2])):
    (row,) = e.decode([BatchRow(seq=0, tokens=tuple(toks), pos0=pos, want_logits=True)])
    pos += len(toks)
    toks = [int(row.argmax())]
    out.append(toks[0])
print(json.dumps({"blas": e.info.extra["blas"], "weights": e.info.extra["weights"], "greedy": out}))
"""


@pytest.mark.real(MLX_DIR)
def test_mlx_cpu_weights_are_dequantized_over_openblas_and_agree_with_the_quantized_ones() -> None:
    """On the CPU device the worker binds OpenBLAS (where the system has it) before mlx loads,
    and then runs the 4-bit weights as f32 (MLX's CPU quantized matmul is ~60x slower than
    OpenBLAS's); greedy output is the quantized model's. ``native`` keeps the 4-bit weights."""
    def probe(n: int = 8, **env: str) -> dict:
        done = subprocess.run([sys.executable, "-c", _WEIGHTS_PROBE, str(MLX_DIR), str(n)], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    from superfluid.worker._mlx import _OPENBLAS

    default, native = probe(), probe(SUPERFLUID_MLX_CPU_WEIGHTS="native")
    have = [p for p in _OPENBLAS if os.path.exists(p)]
    if have:
        assert default["blas"] == have[0] and default["weights"] == "f32", default
    else:
        assert default["blas"] == "the wheel's own" and default["weights"] == "native", default
    assert native["weights"] == "native"
    assert default["greedy"] == native["greedy"], (default, native)
    assert probe(1, SUPERFLUID_MLX_BLAS="0")["blas"] == "the wheel's own"


@pytest.mark.real(MLX_DIR)
def test_mlx_prompt_pass_aborts_between_pieces_and_leaves_the_kv_as_before() -> None:
    """A prompt pass given ``abort`` runs in pieces of ABORT_PIECE tokens and asks between them:
    aborted, every row's cache is back at its ``pos0`` and the re-run's logits are an unaborted
    pass's (the QoS path: a chat arriving mid-prompt waits one piece, not the whole pass)."""
    import numpy as np

    from superfluid.worker._engine import BatchRow, StepAborted
    from superfluid.worker._mlx import ABORT_PIECE, MlxEngine

    engine = MlxEngine(str(MLX_DIR), max_batch=2, max_context=1024)
    try:
        prompt = tuple(engine.tokenize("The quick brown fox jumps over the lazy dog. " * 40, add_special=False,
                                       parse_special=False))[: 2 * ABORT_PIECE + 40]
        for seq in (0, 1):
            engine.decode([BatchRow(seq=seq, tokens=prompt[:10], pos0=0, want_logits=False)])
        asked: list[int] = []

        def after_one_piece() -> bool:
            asked.append(engine._caches[0][0].offset)
            return len(asked) > 1

        rest = BatchRow(seq=0, tokens=prompt[10:], pos0=10, want_logits=True)
        with pytest.raises(StepAborted):
            engine.decode([rest], after_one_piece)
        assert asked == [10, 10 + ABORT_PIECE]              # asked before each piece: one piece ran
        assert engine._caches[0][0].offset == 10            # and was taken back
        (again,) = engine.decode([rest], lambda: False)
        (whole,) = engine.decode([BatchRow(seq=1, tokens=prompt[10:], pos0=10, want_logits=True)])
        assert int(again.argmax()) == int(whole.argmax())
        assert np.max(np.abs(again - whole)) < 1e-2         # pieces vs one pass: float reassociation only
    finally:
        engine.close()


@pytest.mark.real(MLX_DIR)
def test_mlx_batched_decode_round_matches_per_lane_passes() -> None:
    """The batched decode round (the GPU default) gives each lane the logits its own pass gives."""
    import numpy as np

    from superfluid.worker._engine import BatchRow
    from superfluid.worker._mlx import MlxEngine

    engine = MlxEngine(str(MLX_DIR), max_batch=2, max_context=128)
    try:
        prompts = [engine.tokenize(t, add_special=False, parse_special=True) for t in ("The quick brown fox",
                                                                                        "List three colors:")]
        for seq, ids in enumerate(prompts):
            engine.decode([BatchRow(seq=seq, tokens=tuple(ids), pos0=0, want_logits=True)])
        rows = [BatchRow(seq=seq, tokens=(ids[-1],), pos0=len(ids), want_logits=True)
                for seq, ids in enumerate(prompts)]
        outs = {}
        for batched in (False, True):
            engine.batch_decode = batched
            outs[batched] = engine.decode(rows)
            for seq, ids in enumerate(prompts):
                assert engine.seq_rm(seq, len(ids), -1)
        for a, b in zip(outs[False], outs[True], strict=True):
            assert int(np.argmax(a)) == int(np.argmax(b))
            assert np.allclose(a, b, atol=0.05), float(np.abs(a - b).max())
    finally:
        engine.close()


def test_mlx_host_sampler_is_counter_seeded_and_applies_its_stages() -> None:
    """The MLX (and baseRT) host sampler in numpy: no model needed."""
    import numpy as np

    from superfluid.worker._mlx import _LaneSampler

    class Fake:
        class info:  # noqa: N801 - stands in for ModelInfo
            n_vocab = 50

        @staticmethod
        def piece(tok: int) -> bytes:
            return bytes([65 + tok % 26])

    rng = np.random.default_rng(0)
    logits = [rng.normal(size=50).astype(np.float32) for _ in range(12)]
    hot = Sampling(temperature=1.5, seed=7)
    whole = _LaneSampler(Fake, hot)  # type: ignore[arg-type]
    draws = [whole.sample(x, k) for k, x in enumerate(logits)]
    assert len(set(draws)) > 3                      # a real distribution, not argmax
    resumed = _LaneSampler(Fake, hot)  # type: ignore[arg-type]
    assert [resumed.sample(x, k) for k, x in enumerate(logits) if k >= 6] == draws[6:]
    other = _LaneSampler(Fake, Sampling(temperature=1.5, seed=8))  # type: ignore[arg-type]
    assert [other.sample(x, k) for k, x in enumerate(logits)] != draws
    x = logits[0]
    top = int(np.argmax(x))
    assert _LaneSampler(Fake, Sampling(temperature=2.0, top_k=1, seed=1)).sample(x, 0) == top  # type: ignore[arg-type]
    banned = _LaneSampler(Fake, Sampling(logit_bias=((top, -float("inf")),)))  # type: ignore[arg-type]
    assert banned.sample(x, 0) != top
    pen = _LaneSampler(Fake, Sampling(presence_penalty=100.0))  # type: ignore[arg-type]
    pen.accept(top)
    assert pen.sample(x, 1) != top
    lp, best = pen.logprobs(x, top, 3)
    assert best[0][0] == top and abs(best[0][2] - lp) < 1e-9 and len(best) == 3
    with pytest.raises(ValueError, match="no grammar engine"):   # an engine without one (baseRT)
        _LaneSampler(Fake, Sampling(grammar="json"))  # type: ignore[arg-type]


GRAMMAR_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "units": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "units"], "additionalProperties": False}


@pytest.mark.real(MLX_DIR)
def test_mlx_host_grammar_constrains_every_draw_and_refuses_what_it_forbids() -> None:
    """The host sampler under a JSON-schema grammar (llguidance on the MLX directory's own
    tokenizer): greedy and sampled draws from random logits spell a schema-valid document, then
    only end-of-generation; a forbidden token is refused; a resumed lane replays its history."""
    import numpy as np

    from superfluid.worker._guidance import Grammars
    from superfluid.worker._mlx import _LaneSampler, _Vocab

    config = json.loads((MLX_DIR / "config.json").read_text())
    vocab = _Vocab(MLX_DIR, config)
    eog = (vocab.token_id("<|im_end|>"),)

    class Fake:
        class info:  # noqa: N801 - stands in for ModelInfo
            n_vocab = vocab.n_vocab

        grammars = Grammars((MLX_DIR / "tokenizer.json").read_text(), vocab.n_vocab, eog)  # type: ignore[arg-type]
        piece = staticmethod(vocab.piece)

    rng = np.random.default_rng(3)
    grammar = "json_schema:" + json.dumps(GRAMMAR_SCHEMA)
    for sampling in (Sampling(grammar=grammar), Sampling(grammar=grammar, temperature=1.0, seed=5)):
        lane = _LaneSampler(Fake, sampling)  # type: ignore[arg-type]
        drawn: list[int] = []
        rows: list[np.ndarray] = []
        for k in range(80):
            rows.append(rng.normal(size=vocab.n_vocab).astype(np.float32) * 4)
            tok = lane.sample(rows[-1], k)
            if tok in eog:
                break
            lane.accept(tok)
            drawn.append(tok)
        else:
            raise AssertionError(f"no end after 80 tokens: {b''.join(map(vocab.piece, drawn))!r}")
        doc = json.loads(b"".join(vocab.piece(t) for t in drawn))
        assert set(doc) == {"city", "units"} and doc["units"] in ("celsius", "fahrenheit"), doc
        # finished: every row draws end-of-generation, whatever the logits say
        assert lane.sample(np.where(np.arange(vocab.n_vocab) == eog[0], -50.0, 50.0).astype(np.float32), 99) == eog[0]
        # a re-admitted lane replays its history into the grammar and draws what the original drew
        resumed = _LaneSampler(Fake, sampling)  # type: ignore[arg-type]
        for tok in drawn[:6]:
            resumed.accept(tok)
        assert [resumed.sample(rows[k], k) for k in (6,)] == drawn[6:7]
    fresh = _LaneSampler(Fake, Sampling(grammar=grammar))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not match the grammar"):
        fresh.accept(vocab.encode("hello", add_special=False, parse_special=False)[0])
    fresh.accept(vocab.encode("{", add_special=False, parse_special=False)[0])   # still usable after a refusal
    with pytest.raises(ValueError, match="invalid grammar|JSON schema"):
        _LaneSampler(Fake, Sampling(grammar='json_schema:{"type": "frob"}'))  # type: ignore[arg-type]
    json_object = _LaneSampler(Fake, Sampling(grammar="json"))  # type: ignore[arg-type]
    first = json_object.sample(rng.normal(size=vocab.n_vocab).astype(np.float32), 0)
    assert vocab.piece(first).startswith(b"{")


def test_the_daemon_side_never_imports_mlx(tmp_path: Path) -> None:
    """Serving an MLX directory loads mlx only in the worker process."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    code = (
        "import sys\n"
        "import superfluid.cli._main, superfluid.daemon._server, superfluid.api._app\n"
        "from superfluid.models._files import resolve_runtime\n"
        f"assert resolve_runtime({str(tmp_path)!r}, None) == 'mlx'\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'llama_cpp')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.real(MLX_DIR)
async def test_mlx_a_conversation_resumes_from_its_park_after_a_daemon_restart(tmp_path: Path) -> None:
    """--park on MLX (its KVCache layers' state as bytes, ``_Exported.to_bytes``): a finished
    turn is parked 0600; after a daemon restart the next turn restores it from disk and, under
    --deterministic, replies with the text a cold prefill gives."""
    import attrs

    from superfluid.worker._park import PARK_MIN_TOKENS, SUFFIX

    from .test_daemon import metric
    from .test_park import LONG_TEXT

    async def chat(c: Any, messages: list[dict[str, str]], salt: str = "") -> tuple[str, int]:
        r = await c.post("/v1/chat/completions", json={
            "model": "smol-mlx", "max_tokens": 8, "temperature": 0, "messages": messages,
            **({"cache_salt": salt} if salt else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = [{"role": "user", "content": LONG_TEXT}]
    base = attrs.evolve(mlx_config(max_batch=1, deterministic=True), sessions=tmp_path / "cold")
    async with open_daemon(base) as d:   # the reference: no --park; turn 2 under another salt prefills cold
        reply, _ = await chat(d.client, first)
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        reference, cached = await chat(d.client, second, salt="cold")
        assert cached == 0
    config = attrs.evolve(base, sessions=tmp_path / "s", park=True, park_budget_gb=0.1)
    async with open_daemon(config) as d:
        assert (await chat(d.client, first))[0] == reply
        with trio.fail_after(60):
            while await metric(d, "superfluid_parks_total") < 1:
                await trio.sleep(0.05)
    [path] = (tmp_path / "s" / "park").glob("*" + SUFFIX)
    assert path.stat().st_mode & 0o777 == 0o600
    async with open_daemon(config) as d:   # a daemon restart: an empty KV, the park on disk
        text, cached = await chat(d.client, second)
        assert text == reference and cached >= PARK_MIN_TOKENS
        assert await metric(d, "superfluid_resumes_total") == 1
        assert await metric(d, "superfluid_park_fallbacks_total") == 0


def test_mlx_state_bytes_read_back_as_written_and_nothing_else() -> None:
    """An MLX export as bytes (a park's or a slot file's payload): each layer's K and V come back
    with their dtype (bfloat16 too) and values; bytes that are short, longer than their header
    says or of another format are refused (ValueError: seq_import answers False, the lane prefills)."""
    mx = pytest.importorskip("mlx.core")
    from superfluid.worker._mlx import STATE_MAGIC, _Exported

    k = mx.arange(2 * 5 * 4, dtype=mx.float32).reshape(1, 2, 5, 4)
    layers = [(k[..., :3, :], (k * 2)[..., :3, :]), (k.astype(mx.bfloat16)[..., :3, :], k[..., :3, :] - 1)]
    data = _Exported(layers, 3).to_bytes()
    assert data.startswith(STATE_MAGIC)
    back = _Exported.from_bytes(data, mx)
    assert back.n == 3 and len(back.layers) == 2
    for (a, b), (c, d) in zip(layers, back.layers, strict=True):
        assert a.dtype == c.dtype and b.dtype == d.dtype
        assert mx.array_equal(a, c).item() and mx.array_equal(b, d).item()
    for bad in (data[:-1], data + b"\0", b"SFPARK\0\1" + data[8:], b""):
        with pytest.raises(ValueError):
            _Exported.from_bytes(bad, mx)
