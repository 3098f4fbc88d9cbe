"""``--kv-bits 16|8``: llama.cpp's K and V cache width (8: q8_0, with flash attention), passed to
the worker; a parked state is stored as the KV is, so one width never restores into the other."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from superfluid.cli._main import _check_limits, build_parser
from superfluid.nursery._worker import WorkerSpec, worker_argv
from superfluid.serving import ModelSource
from superfluid.worker._main import load_engine, park_identity
from superfluid.worker._park import ParkStore

from .conftest import REAL_GGUF


def test_kv_bits_is_16_or_8(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["serve"]).kv_bits == 16
    assert build_parser().parse_args(["serve", "--kv-bits", "8"]).kv_bits == 8
    for bad in ("4", "32", "x"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", "--kv-bits", bad])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and "argument --kv-bits:" in err, err


def test_kv_bits_8_is_refused_where_it_cannot_hold() -> None:
    def check(bits: int, runtime: str = "llamacpp", deterministic: bool = False) -> str | None:
        args = argparse.Namespace(model_dirs=[], max_models=4, aliases=[], kv_bits=bits, deterministic=deterministic)
        return _check_limits(args, (ModelSource(spec="x.gguf", runtime=runtime, name="m"),))

    assert check(8) is None and check(16, "mlx") is None and check(16, deterministic=True) is None
    assert check(8, "mlx") == "--kv-bits 8: model 'm' runs on mlx, whose KV cache is 16-bit only"
    assert check(8, "mock") == "--kv-bits 8: model 'm' runs on mock, whose KV cache is 16-bit only"
    assert "--deterministic" in (check(8, deterministic=True) or "")
    with pytest.raises(ValueError, match="16-bit only"):   # a model loaded later (--model-dir): its worker refuses
        load_engine("mock", "mock", max_batch=2, max_context=64, threads=1, kv_bits=8)


def test_kv_bits_8_on_the_mock_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "superfluid", "serve", "--runtime", "mock", "--kv-bits", "8",
                           "--sessions", str(tmp_path / "s")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SUPERFLUID_HOME": str(tmp_path / "home")})
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "superfluid: --kv-bits 8: model 'mock' runs on mock, whose KV cache is 16-bit only"), proc.stderr


def test_the_worker_is_told_its_kv_width() -> None:
    assert "--kv-bits" not in worker_argv(WorkerSpec(runtime="llamacpp", model="m"))
    argv = worker_argv(WorkerSpec(runtime="llamacpp", model="m", kv_bits=8))
    assert argv[argv.index("--kv-bits") + 1] == "8"


@pytest.mark.real
def test_real_model_q8_kv_generates_and_never_restores_a_16_bit_park(tmp_path: Path) -> None:
    """SmolLM2 with a q8_0 KV: the context is made (flash attention on), greedy text comes out, its
    ``kv_type`` names q8_0, and a park written by the 16-bit KV is not usable by it, nor the reverse."""
    from superfluid.worker._executor import Executor

    from . import test_llamacpp_engine as real

    args = argparse.Namespace(model=str(REAL_GGUF), runtime="llamacpp", deterministic=False)
    engines = {bits: load_engine("llamacpp", str(REAL_GGUF), max_batch=2, max_context=1024, threads=2, kv_bits=bits)
               for bits in (16, 8)}
    try:
        assert engines[8].info.extra["kv_type"] == "8/8" and engines[16].info.extra["kv_type"] == "1/1"
        ids = {bits: park_identity(args, engine) for bits, engine in engines.items()}
        assert ids[8] != ids[16]
        text = "Here is a long story about a lighthouse keeper and the sea. " * 30
        parks = {}
        for bits, engine in engines.items():
            tokens = real.prompt(engine, text)[:400]
            st = ParkStore(tmp_path / f"park{bits}", 1 << 30, ids[bits])
            ex = Executor(engine, max_lanes=2, park=st)
            real.admit(ex, 0, tokens, max_new=8)
            out = real.tokens_of(real.drain(ex)[0])
            assert len(out) == 8
            st.flush()
            assert st.snapshot()["parks"] == 1
            st.close()
            parks[bits] = tokens
        for bits, other in ((8, 16), (16, 8)):   # each directory opened by the other width: nothing usable
            st = ParkStore(tmp_path / f"park{other}", 1 << 30, ids[bits])
            assert len(st) == 1 and st.best(parks[other], 399, "", whole=False) is None
            st.close()
    finally:
        for engine in engines.values():
            engine.close()


@pytest.mark.real
async def test_real_daemon_serves_with_a_q8_kv() -> None:
    """``--kv-bits 8`` reaches the worker: the model loads with a q8_0 KV and answers."""
    import attrs

    from .conftest import open_daemon, worker_pids
    from .test_real_daemon import real_config

    async with open_daemon(attrs.evolve(real_config(REAL_GGUF, "smol", max_batch=1, max_context=512),
                                        kv_bits=8)) as d:
        r = await d.client.post("/v1/completions", json={"model": "smol", "prompt": "The sea is", "max_tokens": 8,
                                                         "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        import psutil

        [pid] = worker_pids("llamacpp")
        cmd = psutil.Process(pid).cmdline()
        assert cmd[cmd.index("--kv-bits") + 1] == "8"
