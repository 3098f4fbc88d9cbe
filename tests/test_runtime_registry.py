"""The runtime registry: format detection, choice, one-line refusals (no model loads here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from superfluid.runtime import _registry as registry
from superfluid.runtime._choose import RuntimeRefused, choose

ROOT = Path(__file__).resolve().parent.parent


def _gguf(tmp_path: Path, name: str = "tiny.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


def _mlx_dir(tmp_path: Path) -> Path:
    d = tmp_path / "Qwen-mlx"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 8)
    return d


def test_detect_by_magic_and_layout(tmp_path: Path) -> None:
    assert registry.detect(_gguf(tmp_path)).id == "llamacpp"
    # the magic wins over the name: a GGUF file called .base is GGUF
    assert registry.detect(_gguf(tmp_path, "odd.base")).id == "llamacpp"
    base = tmp_path / "m.base"
    base.write_bytes(b"BASE" + b"\0" * 12)
    assert registry.detect(base).id == "basert"
    assert registry.detect(_mlx_dir(tmp_path)).id == "mlx"
    assert registry.detect("mock?step_ms=1").id == "mock"
    assert registry.detect("mock").id == "mock"
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    assert registry.detect(junk) is None
    assert registry.detect(tmp_path / "absent.gguf").id == "llamacpp"  # by name when there is nothing to read


def test_aliases_and_unknown() -> None:
    assert registry.get("llama.cpp").id == "llamacpp"
    assert registry.get("LLAMA-CPP").id == "llamacpp"
    assert registry.get("native").id == "basert"
    with pytest.raises(registry.UnknownRuntime, match="known: llamacpp, mlx, basert, mock"):
        registry.get("vllm")


def test_mismatch_is_one_sentence_with_the_fix(tmp_path: Path) -> None:
    base = tmp_path / "model.base"
    base.write_bytes(b"BASE" + b"\0" * 12)
    with pytest.raises(RuntimeRefused) as info:
        choose(str(base), "llamacpp")
    assert str(info.value) == ("runtime llamacpp cannot serve model.base: it reads a GGUF file, and this is "
                               "a .base bundle (pass --runtime basert, or convert the model)")


def test_choose_by_format_and_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path / "home"))
    base = tmp_path / "model.base"
    base.write_bytes(b"BASE" + b"\0" * 12)
    with pytest.raises(RuntimeRefused, match=r"runtime basert is not installed .*`superfluid runtime install "
                                             r"basert --from URL --sha256 H --version V`"):
        choose(str(base), None)
    assert choose("mock?step_ms=1", "auto").info.id == "mock"


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SUPERFLUID_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "superfluid", *args], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


@pytest.mark.parametrize("runtime", ["mlx", "basert", "vllm"])
def test_serve_refuses_a_runtime_in_one_line(tmp_path: Path, runtime: str) -> None:
    proc = _cli("serve", str(_gguf(tmp_path)), "--runtime", runtime, "--port", "0", home=tmp_path / "home")
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    if runtime != "vllm":
        assert f"runtime {runtime} cannot serve tiny.gguf" in proc.stderr
        assert "pass --runtime llamacpp" in proc.stderr


def test_serve_refuses_a_base_bundle_with_the_install_command(tmp_path: Path) -> None:
    base = tmp_path / "model.base"
    base.write_bytes(b"BASE" + b"\0" * 12)
    proc = _cli("serve", str(base), "--port", "0", home=tmp_path / "home")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("superfluid: runtime basert is not installed (libbasert not found: "
                                   "BASERT_LIB is not set): run `superfluid runtime install basert --from URL "
                                   "--sha256 H --version V`")


async def test_http_load_refuses_a_runtime_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from .conftest import mock_config, open_daemon

    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path / "home"))
    models = tmp_path / "models"
    models.mkdir()
    _gguf(models)
    outside = tmp_path / "outside"
    outside.mkdir()
    _gguf(outside, "secret.gguf")
    async with open_daemon(mock_config(model_dirs=(models,))) as d:
        cases = [
            ({"id": "tiny", "runtime": "vllm"}, "unknown runtime 'vllm' (known: llamacpp, mlx, basert, mock)"),
            ({"id": str(models / "tiny.gguf"), "runtime": "native"},
             "runtime basert cannot serve tiny.gguf: it reads a .base bundle, and this is a GGUF file "
             "(pass --runtime llamacpp, or convert the model)"),
        ]
        for body, message in cases:
            r = await d.client.post("/v1/models/load", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["code"], err["param"], err["message"]) == ("unsupported_runtime", "runtime", message)
        # a file outside the allowed places is not read for its format: the same 404 as a missing one
        for ident in (str(outside / "secret.gguf"), str(outside / "missing.gguf")):
            r = await d.client.post("/v1/models/load", json={"id": ident, "runtime": "basert"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await d.client.post("/v1/models/load", json={"id": "mock?name=other", "runtime": "mock"})
        assert r.status_code == 200, r.text


def test_detect_never_opens_a_fifo_or_chokes_on_a_nul(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert registry.detect_format(fifo) is None  # opening it would block until a writer came
    assert registry.detect_format("sec\x00ret.gguf") == "gguf"  # judged by its name, no ValueError
