"""Runtime installs, for real: archives and a package index served over HTTP by a thread in
the test, fetched, verified, staged, checked and switched into a temporary SUPERFLUID_HOME.
No internet."""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from superfluid.runtime import _home
from superfluid.runtime import _install as inst
from superfluid.runtime import _registry as registry
from superfluid.runtime._status import states, worker_command

ROOT = Path(__file__).resolve().parent.parent

WORKER_SCRIPT = """#!/bin/sh
if [ "$1" = check ]; then echo '{"runtime": "basert", "available": true}'; exit 0; fi
echo "test basert worker $*" >&2
exit 3
"""


# -- artifacts and a server ----------------------------------------------------------------


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    return info, data


def worker_archive(path: Path, *, version: str = "1", extra: bytes = b"data") -> str:
    """A basert install archive: an executable worker that passes its check, and a data file."""
    return _tar(path, [_file("bin/superfluid-worker-basert", WORKER_SCRIPT.encode(), 0o755),
                       _file("lib/engine.txt", extra + version.encode())])


class Server:
    def __init__(self, root: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, Server]]:
    root = tmp_path / "www"
    root.mkdir()
    server = Server(root)
    try:
        yield root, server
    finally:
        server.close()


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    monkeypatch.setenv("SUPERFLUID_HOME", str(path))
    monkeypatch.delenv("SUPERFLUID_WORKER_BASERT", raising=False)
    return path


def _plan(archive: Path | str, sha: str | None, version: str, **kw: object) -> inst.Plan:
    return inst.make_plan("basert", from_=str(archive), sha256=sha, version=version, **kw)  # type: ignore[arg-type]


def _leftovers(rid: str = "basert") -> list[str]:
    base = _home.runtime_dir(rid)
    return sorted(n for n in os.listdir(base) if n.startswith((_home.STAGING, _home.OLD))) if base.exists() else []


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "superfluid", *args], capture_output=True, text=True, env=full,
                          timeout=120, check=False)


# -- archives ------------------------------------------------------------------------------


def test_good_install_over_http_then_runtimes_json(served: tuple[Path, Server], home: Path) -> None:
    root, server = served
    sha = worker_archive(root / "basert-1.2.0.tar.gz", version="1.2.0")
    url = f"{server.url}/basert-1.2.0.tar.gz"
    proc = cli("runtime", "install", "basert", "--from", url, "--sha256", sha, "--version", "1.2.0")
    assert proc.returncode == 0, proc.stderr
    assert "installed basert 1.2.0-cpu" in proc.stdout
    for step in inst.ARCHIVE_STEPS:
        assert f"] {step}" in proc.stderr
    base = home / "runtimes" / "basert"
    assert os.readlink(base / "current") == "1.2.0-cpu"
    record = json.loads((base / "1.2.0-cpu" / "runtime.json").read_text())
    assert record["sources"] == [{"source": url, "sha256": sha}]
    assert record["files"]["lib/engine.txt"] == hashlib.sha256(b"data1.2.0").hexdigest()
    assert (base / "1.2.0-cpu" / "install.log").stat().st_mode & 0o777 == 0o600
    assert _leftovers() == []

    proc = cli("runtimes", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [r["id"] for r in doc["runtimes"]] == ["llamacpp", "mlx", "basert", "mock"]
    for rt in doc["runtimes"]:
        assert set(rt) == {"id", "aliases", "formats", "summary", "engine", "installs"}
        for row in rt["installs"]:
            assert set(row) == {"runtime", "install", "state", "version", "backend", "formats", "device", "worker",
                                "default", "pinned", "problems"}
            assert row["state"] in ("ready", "not installed", "broken", "missing")
            for p in row["problems"]:
                assert set(p) == {"problem", "fix"}
    (basert,) = [r for r in doc["runtimes"] if r["id"] == "basert"]
    assert basert["installs"] == [{
        "runtime": "basert", "install": "1.2.0-cpu", "state": "ready", "version": "1.2.0", "backend": "cpu",
        "formats": ["base"], "device": "cpu", "worker": str(base / "1.2.0-cpu" / "bin" / "superfluid-worker-basert"),
        "default": True, "pinned": False, "problems": []}]
    (mlx,) = [r for r in doc["runtimes"] if r["id"] == "mlx"]
    import importlib.util

    mlx_here = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
    assert mlx["installs"][0]["state"] == ("ready" if mlx_here else "not installed")


def test_runtimes_model_says_which_runtime_serves_it(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    base = tmp_path / "tiny.base"
    base.write_bytes(b"BASE" + b"\0" * 60)
    proc = cli("runtimes", str(base), "--json", "--no-check")
    assert proc.returncode == 1  # basert is not installed here: nothing serves it
    model = json.loads(proc.stdout)["model"]
    assert model["format"] == "base" and model["runtime"] == "basert" and not model["serves"]
    assert "superfluid runtime install basert" in model["problem"]
    assert "runtime llamacpp cannot serve tiny.base" in model["refused"]["llamacpp"]
    proc = cli("runtimes", "mock?step_ms=1", "--no-check")
    assert proc.returncode == 0 and "read by runtime mock" in proc.stdout


def test_wrong_sha256_installs_nothing(served: tuple[Path, Server], home: Path) -> None:
    root, server = served
    worker_archive(root / "b.tar.gz")
    proc = cli("runtime", "install", "basert", "--from", f"{server.url}/b.tar.gz", "--sha256", "ab" * 32,
               "--version", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("superfluid: ")
    assert "is not the expected abab" in proc.stderr and "nothing was installed" in proc.stderr
    assert _home.installs("basert") == [] and _home.current("basert") is None and _leftovers() == []


def test_remote_archive_without_sha256_or_over_http_is_refused(served: tuple[Path, Server]) -> None:
    proc = cli("runtime", "install", "basert", "--from", "https://example.invalid/b.tar.gz", "--version", "1")
    assert proc.returncode == 2 and "needs a SHA-256" in proc.stderr
    proc = cli("runtime", "install", "basert", "--from", "http://example.invalid/b.tar.gz", "--sha256", "ab" * 32)
    assert proc.returncode == 2 and "https:// only" in proc.stderr


def test_local_archive_without_sha256_installs_with_a_warning(tmp_path: Path) -> None:
    worker_archive(tmp_path / "b.tar.gz")
    proc = cli("runtime", "install", "basert", "--from", str(tmp_path / "b.tar.gz"), "--version", "1")
    assert proc.returncode == 0, proc.stderr
    assert "warning" in proc.stderr and "unverified" in proc.stderr


@pytest.mark.parametrize("members", [
    [_file("../escape.txt", b"x")],
    [_file("bin/../../escape.txt", b"x")],
    [_file("/tmp/absolute.txt", b"x")],
    "symlink-out",
    "hardlink-out",
    "device",
], ids=["dotdot", "nested-dotdot", "absolute", "symlink-out", "hardlink-out", "device"])
def test_unsafe_archives_fail_the_install(tmp_path: Path, home: Path, members: object) -> None:
    good = [_file("bin/superfluid-worker-basert", WORKER_SCRIPT.encode(), 0o755)]
    if members == "symlink-out":
        link = tarfile.TarInfo("lib/passwd")
        link.type, link.linkname = tarfile.SYMTYPE, "../../../../etc/passwd"
        members = [(link, None)]
    elif members == "hardlink-out":
        link = tarfile.TarInfo("lib/passwd")
        link.type, link.linkname = tarfile.LNKTYPE, "/etc/passwd"
        members = [(link, None)]
    elif members == "device":
        dev = tarfile.TarInfo("lib/null")
        dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
        members = [(dev, None)]
    archive = tmp_path / "evil.tar.gz"
    sha = _tar(archive, [*good, *members])  # type: ignore[list-item]
    plan = _plan(archive, sha, "6")
    with pytest.raises(inst.InstallError, match="unsafe archive"):
        trio.run(inst.install, plan)
    assert _home.installs("basert") == [] and _leftovers() == []
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/absolute.txt").exists()


def test_zip_symlink_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        info = zipfile.ZipInfo("bin/superfluid-worker-basert")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/bin/sh")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    with pytest.raises(inst.InstallError, match="symbolic link"):
        trio.run(inst.install, _plan(archive, sha, "7"))


# -- cancellation and killing --------------------------------------------------------------


def _install_v1(tmp_path: Path) -> None:
    sha = worker_archive(tmp_path / "v1.tar.gz", version="1")
    trio.run(inst.install, _plan(tmp_path / "v1.tar.gz", sha, "1"))
    assert _home.current("basert") == "1-cpu"


def _v1_intact() -> None:
    assert _home.installs("basert") == ["1-cpu"]
    assert _home.current("basert") == "1-cpu"
    assert inst.verify("basert", "1-cpu") == []
    assert worker_command("basert")[0].endswith("1-cpu/bin/superfluid-worker-basert")


@pytest.mark.parametrize("step", inst.ARCHIVE_STEPS)
def test_cancel_at_each_step_keeps_the_previous_install(tmp_path: Path, step: str) -> None:
    _install_v1(tmp_path)
    sha = worker_archive(tmp_path / "v2.tar.gz", version="2")
    reached = []

    async def main() -> None:
        with trio.CancelScope() as scope:
            async def hook(name: str) -> None:
                await trio.lowlevel.checkpoint()
                if name == step:
                    reached.append(name)
                    scope.cancel()   # Ctrl-C's trio equivalent: a cancel arrives at this step
                    await trio.sleep_forever()

            await inst.install(_plan(tmp_path / "v2.tar.gz", sha, "2"), hook=hook)
        assert scope.cancelled_caught

    trio.run(main)
    assert reached == [step]
    _v1_intact()
    assert _leftovers() == []  # a cancelled install cleans its own staging directory


@pytest.mark.parametrize("step", ["fetch", "unpack", "check", "switch"])
def test_killed_at_a_step_keeps_the_previous_install_and_the_next_start_cleans_up(tmp_path: Path, step: str) -> None:
    _install_v1(tmp_path)
    sha = worker_archive(tmp_path / "v2.tar.gz", version="2")
    proc = cli("runtime", "install", "basert", "--from", str(tmp_path / "v2.tar.gz"), "--sha256", sha,
               "--version", "2", env={"SUPERFLUID_INSTALL_FAULT": f"{step}:kill"})
    assert proc.returncode == -9
    assert any(n.startswith(_home.STAGING) for n in _leftovers())  # what a killed install leaves...
    _v1_intact()
    proc = cli("runtimes", "--no-check")  # ...the next start removes
    assert proc.returncode == 0, proc.stderr
    assert _leftovers() == []
    _v1_intact()


def test_ctrl_c_on_the_command_line(tmp_path: Path) -> None:
    _install_v1(tmp_path)
    sha = worker_archive(tmp_path / "v2.tar.gz", version="2")
    proc = cli("runtime", "install", "basert", "--from", str(tmp_path / "v2.tar.gz"), "--sha256", sha,
               "--version", "2", env={"SUPERFLUID_INSTALL_FAULT": "unpack:interrupt"})
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "superfluid: interrupted; the installs are as they were"
    _v1_intact()
    assert _leftovers() == []


def test_a_failed_check_keeps_the_previous_install(tmp_path: Path) -> None:
    _install_v1(tmp_path)
    bad = tmp_path / "bad.tar.gz"
    sha = _tar(bad, [_file("bin/superfluid-worker-basert", b"#!/bin/sh\necho nope >&2\nexit 1\n", 0o755)])
    with pytest.raises(inst.InstallError, match="failed its check.*nope"):
        trio.run(inst.install, _plan(bad, sha, "2"))
    _v1_intact()
    assert _leftovers() == []


def test_interrupted_replacement_is_restored_at_the_next_start(tmp_path: Path) -> None:
    """A process killed between the two renames of a replacement (repair) leaves the old
    install aside as .old-<install>-*: the next start puts it back."""
    _install_v1(tmp_path)
    base = _home.runtime_dir("basert")
    os.rename(base / "1-cpu", base / ".old-1-cpu-0badf00d")
    (base / ".staging-1-cpu-12345678").mkdir()
    assert cli("runtimes", "--no-check").returncode == 0
    _v1_intact()
    assert _leftovers() == []


def test_two_concurrent_installs_run_one_after_the_other(tmp_path: Path) -> None:
    shas = {v: worker_archive(tmp_path / f"v{v}.tar.gz", version=v) for v in ("1", "2")}
    order: list[tuple[str, str]] = []
    notes: list[str] = []

    class Notes(inst.Progress):
        def note(self, text: str) -> None:
            notes.append(text)

    async def main() -> None:
        first_in = trio.Event()

        def hook_for(version: str):  # noqa: ANN202
            async def hook(name: str) -> None:
                order.append((version, name))
                if version == "1" and name == "fetch":
                    first_in.set()
                    while not notes:  # hold the first until the second is seen waiting for the lock
                        await trio.sleep(0.01)
            return hook

        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(inst.install, _plan(tmp_path / "v1.tar.gz", shas["1"], "1"),
                                                 hook=hook_for("1")))
            await first_in.wait()
            nursery.start_soon(functools.partial(inst.install, _plan(tmp_path / "v2.tar.gz", shas["2"], "2"),
                                                 hook=hook_for("2"), progress=Notes()))

    trio.run(main)
    assert "another install of basert is running" in notes[0]
    firsts = [v for v, _ in order]
    assert firsts == ["1"] * len(inst.ARCHIVE_STEPS) + ["2"] * len(inst.ARCHIVE_STEPS)  # never interleaved
    assert _home.installs("basert") == ["1-cpu", "2-cpu"]
    assert _home.current("basert") == "2-cpu"  # the newest ranks first
    assert _leftovers() == []


# -- repair, remove, use -------------------------------------------------------------------


def test_repair_after_a_file_is_corrupted(tmp_path: Path) -> None:
    _install_v1(tmp_path)
    proc = cli("runtime", "repair", "basert")
    assert proc.returncode == 0 and "is intact" in proc.stdout
    data = _home.runtime_dir("basert") / "1-cpu" / "lib" / "engine.txt"
    data.write_bytes(b"corrupted")
    assert inst.verify("basert", "1-cpu") == ["lib/engine.txt differs"]
    assert states("basert")[0].state == "ready"  # the cheap look does not hash: repair does
    proc = cli("runtime", "repair", "basert", "1-cpu")
    assert proc.returncode == 0, proc.stderr
    assert "repaired basert 1-cpu (it had: lib/engine.txt differs)" in proc.stdout
    assert data.read_bytes() == b"data1"
    _v1_intact()


def test_broken_install_is_reported_with_its_fix(tmp_path: Path) -> None:
    _install_v1(tmp_path)
    (_home.runtime_dir("basert") / "1-cpu" / "bin" / "superfluid-worker-basert").unlink()
    (row,) = states("basert")
    assert row.state == "broken"
    assert row.problems[0]["fix"] == "superfluid runtime repair basert 1-cpu"
    proc = cli("serve", "--runtime", "basert", str(_base_file(tmp_path)), "--port", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("superfluid: runtime basert install 1-cpu is broken ("
                                   f"{_home.runtime_dir('basert')}/1-cpu/bin/superfluid-worker-basert is missing): "
                                   "run `superfluid runtime repair basert 1-cpu`")
    assert cli("runtime", "repair", "basert").returncode == 0
    _v1_intact()


def test_remove_the_current_install(tmp_path: Path) -> None:
    for v in ("1", "2"):
        sha = worker_archive(tmp_path / f"v{v}.tar.gz", version=v)
        trio.run(inst.install, _plan(tmp_path / f"v{v}.tar.gz", sha, v))
    assert _home.current("basert") == "2-cpu"
    proc = cli("runtime", "remove", "basert", "2-cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "removed basert 2-cpu; the default is now 1-cpu"
    _v1_intact()
    proc = cli("runtime", "remove", "basert")
    assert proc.returncode == 0
    assert _home.installs("basert") == [] and _home.current("basert") is None and _leftovers() == []
    proc = cli("runtime", "remove", "basert", "9-cpu")
    assert proc.returncode == 2 and "no install '9-cpu'" in proc.stderr


def test_use_pins_and_auto_ranks(tmp_path: Path) -> None:
    for v in ("1", "2"):
        sha = worker_archive(tmp_path / f"v{v}.tar.gz", version=v)
        trio.run(inst.install, _plan(tmp_path / f"v{v}.tar.gz", sha, v))
    assert cli("runtime", "use", "basert", "1-cpu").returncode == 0
    assert _home.pinned("basert") == "1-cpu" and _home.current("basert") == "1-cpu"
    sha = worker_archive(tmp_path / "v3.tar.gz", version="3")
    trio.run(inst.install, _plan(tmp_path / "v3.tar.gz", sha, "3"))
    assert _home.current("basert") == "1-cpu"  # pinned: a newer install does not move the default
    assert worker_command("basert")[0].endswith("/1-cpu/bin/superfluid-worker-basert")
    proc = cli("runtime", "use", "basert", "--auto")
    assert proc.returncode == 0 and "the default install is 3-cpu (ranked)" in proc.stdout
    assert _home.pinned("basert") is None and _home.current("basert") == "3-cpu"
    # a GPU backend ranks before cpu, whatever the version
    sha = worker_archive(tmp_path / "v0.tar.gz", version="0")
    trio.run(inst.install, _plan(tmp_path / "v0.tar.gz", sha, "0", backend="cuda"))
    assert _home.current("basert") == "0-cuda"
    assert cli("runtime", "use", "basert", "nope-cpu").returncode == 2
    assert cli("runtime", "use", "basert").returncode == 2


# -- serve picks the install ---------------------------------------------------------------


def _base_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.base"
    path.write_bytes(b"BASE" + b"\0" * 60)
    return path


def test_serve_chooses_the_runtime_by_format_and_starts_the_install_worker(tmp_path: Path) -> None:
    _install_v1(tmp_path)
    model = _base_file(tmp_path)
    proc = cli("serve", str(model), "--port", "0", "--sessions", str(tmp_path / "s"), "--log-level", "ERROR")
    # the test worker runs, says who it is, and exits 3: the daemon reports it in one line
    assert f"test basert worker superfluid-worker-basert --model {model}" in proc.stderr
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("superfluid: worker did not start: ")
    assert "Traceback" not in proc.stderr
    # ID@INSTALL: an install that is not there
    proc = cli("serve", str(model), "--runtime", "basert@9-cpu", "--port", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "superfluid: runtime basert has no install '9-cpu' (installs: 1-cpu, in-process)"


def test_worker_env_var_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_v1(tmp_path)
    monkeypatch.setenv("SUPERFLUID_WORKER_BASERT", "/opt/my-worker")
    assert worker_command("basert") == ("/opt/my-worker",)
    assert worker_command("basert", "1-cpu")[0].endswith("1-cpu/bin/superfluid-worker-basert")


# -- a Python runtime: a private environment from a local package index --------------------


def _wheel(directory: Path, name: str = "sftoy", version: str = "1.0") -> Path:
    """A pure-Python wheel, built here."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'__version__ = "{version}"\n'.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


@pytest.fixture
def toy_index(served: tuple[Path, Server]) -> Iterator[tuple[str, str]]:
    """A PEP 503 index with one tiny package; yields (index URL, the wheel's sha256)."""
    root, server = served
    pkg = root / "simple" / "sftoy"
    pkg.mkdir(parents=True)
    wheel = _wheel(pkg)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (pkg / "index.html").write_text(f'<html><body><a href="{wheel.name}#sha256={sha}">{wheel.name}</a></body></html>')
    yield f"{server.url}/simple", sha


def _toy(index: str, sha: str) -> registry.RuntimeInfo:
    source = registry.PythonSource(version="1.0", packages=(registry.Package("sftoy", "1.0", (sha,)),), index=index)
    return registry.RuntimeInfo(id="sftoy", aliases=(), engine="superfluid.worker._mock", formats=(),
                                requires=("sftoy",), source=source)


@pytest.fixture
def toy_registered(toy_index: tuple[str, str]) -> Iterator[registry.RuntimeInfo]:
    info = registry.register(_toy(*toy_index))
    try:
        yield info
    finally:
        del registry.RUNTIMES["sftoy"]


def test_python_runtime_installs_a_private_environment(toy_registered: registry.RuntimeInfo, home: Path) -> None:
    plan = inst.make_plan("sftoy")
    assert plan.kind == "venv" and plan.install == "1.0-cpu"
    record = trio.run(inst.install, plan)
    base = home / "runtimes" / "sftoy" / "1.0-cpu"
    assert record["interpreter"] == "env/bin/python"
    assert record["check"]["modules"]["sftoy"]["file"].startswith(str(base.parent))  # from the staged env
    command = worker_command("sftoy")
    assert command == (str(base / "env" / "bin" / "python"), "-m", "superfluid.worker")
    (row,) = states("sftoy")  # starts the install's interpreter: superfluid.worker and sftoy import
    assert row.state == "ready", row.problems
    log = (base / "install.log").read_text()
    assert "--require-hashes" in log and "--only-binary sftoy" in log
    assert inst.verify("sftoy", "1.0-cpu") == []


def test_python_runtime_wrong_hash_installs_nothing(toy_index: tuple[str, str], home: Path) -> None:
    info = registry.register(_toy(toy_index[0], "0" * 64))
    try:
        with pytest.raises(inst.InstallError, match="pip could not install"):
            trio.run(inst.install, inst.make_plan("sftoy"))
    finally:
        del registry.RUNTIMES[info.id]
    assert _home.installs("sftoy") == [] and _leftovers("sftoy") == []


def test_credentials_never_reach_the_check_or_the_log(toy_registered: registry.RuntimeInfo, home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue")
    monkeypatch.setenv("MY_API_KEY", "sk-anothersecret")
    seen: list[dict[str, str]] = []
    real = inst.run_check

    def spy(command: tuple[str, ...], rid: str, modules: tuple[str, ...] = (), env: dict[str, str] | None = None):  # noqa: ANN202
        seen.append(dict(env or {}))
        return real(command, rid, modules, env=env)

    monkeypatch.setattr(inst, "run_check", spy)
    trio.run(inst.install, inst.make_plan("sftoy"))
    assert seen and not {"HF_TOKEN", "MY_API_KEY"} & set(seen[0])
    log = (home / "runtimes" / "sftoy" / "1.0-cpu" / "install.log").read_text()
    assert "hf_supersecretvalue" not in log and "sk-anothersecret" not in log
    assert inst.redact("https://user:hf_supersecretvalue@host/x") == "https://***@host/x"


def test_dry_run_prints_the_plan_and_fetches_nothing(home: Path) -> None:
    proc = cli("runtime", "install", "llamacpp", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "install llamacpp 0.3.36-cpu (version 0.3.36, backend cpu, venv)"
    assert "llama-cpp-python==0.3.36" in proc.stdout and "(dry run: nothing fetched)" in proc.stdout
    assert not (home / "runtimes" / "llamacpp").exists() or _home.installs("llamacpp") == []
    proc = cli("runtime", "install", "llamacpp", "--backend", "metal", "--dry-run")
    assert proc.returncode == 2 and "no 'metal' backend" in proc.stderr
    proc = cli("runtime", "install", "mock")
    assert proc.returncode == 2 and "built in" in proc.stderr


def test_python_runtime_ignores_what_superfluid_environment_has(served: tuple[Path, Server], home: Path) -> None:
    """A package superfluid's own environment holds at the pinned version is still installed
    into the private environment (pip must not see superfluid's site-packages)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("diskcache")  # present with the llamacpp extra, unused by superfluid itself
    except PackageNotFoundError:
        pytest.skip("needs a distribution in superfluid's environment that the worker does not import")
    root, server = served
    pkg = root / "simple" / "diskcache"
    pkg.mkdir(parents=True)
    wheel = _wheel(pkg, "diskcache", have)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (pkg / "index.html").write_text(f'<a href="{wheel.name}#sha256={sha}">{wheel.name}</a>')
    source = registry.PythonSource(version=have, packages=(registry.Package("diskcache", have, (sha,)),),
                                   index=f"{server.url}/simple")
    info = registry.register(registry.RuntimeInfo(id="sfdc", aliases=(), engine="superfluid.worker._mock",
                                                  formats=(), requires=("diskcache",), source=source))
    try:
        record = trio.run(inst.install, inst.make_plan("sfdc"))
    finally:
        del registry.RUNTIMES[info.id]
    assert record["check"]["modules"]["diskcache"]["file"].startswith(str(home))


def test_serve_installs_on_first_use_unless_offline(toy_registered: registry.RuntimeInfo, home: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from superfluid.cli._main import _sources, build_parser

    registry.RUNTIMES["sftoy"] = dataclasses.replace(toy_registered, formats=("mock",))
    offline = build_parser().parse_args(["serve", "mock", "--runtime", "sftoy", "--offline"])
    with pytest.raises(SystemExit) as exited:
        _sources(offline)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == ("superfluid: runtime sftoy is not installed (sftoy is not importable): "
                                               "run `superfluid runtime install sftoy`")
    assert _home.installs("sftoy") == []
    (source,) = _sources(build_parser().parse_args(["serve", "mock", "--runtime", "sftoy"]))
    assert "installing it (--offline refuses instead)" in capsys.readouterr().err
    assert source.runtime == "sftoy"
    assert source.worker == (str(home / "runtimes" / "sftoy" / "1.0-cpu" / "env" / "bin" / "python"), "-m",
                             "superfluid.worker")


def test_serve_is_a_next_start_too(tmp_path: Path) -> None:
    _install_v1(tmp_path)
    sha = worker_archive(tmp_path / "v2.tar.gz", version="2")
    proc = cli("runtime", "install", "basert", "--from", str(tmp_path / "v2.tar.gz"), "--sha256", sha,
               "--version", "2", env={"SUPERFLUID_INSTALL_FAULT": "check:kill"})
    assert proc.returncode == -9 and _leftovers()
    proc = cli("serve", "mock", "--runtime", "vllm", "--port", "0")  # refused, but only after cleaning up
    assert proc.returncode == 2
    assert _leftovers() == []
    _v1_intact()


def test_update_installs_the_tested_build_and_makes_it_the_default(toy_registered: registry.RuntimeInfo,
                                                                  home: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from superfluid.cli._main import build_parser
    from superfluid.cli._runtimes import run

    # an older install of another kind, pinned: update moves the default (and the pin) to the tested build
    base = _home.runtime_dir("sftoy")
    (base / "0.9-cpu").mkdir(parents=True)
    (base / "0.9-cpu" / "runtime.json").write_text(json.dumps({"id": "sftoy", "version": "0.9", "backend": "cpu"}))
    _home.set_pinned("sftoy", "0.9-cpu")
    _home.switch_current("sftoy", "0.9-cpu")
    dry = run(build_parser().parse_args(["runtime", "update", "sftoy", "--dry-run"]))
    assert dry == 0 and "install sftoy 1.0-cpu" in capsys.readouterr().out
    assert _home.installs("sftoy") == ["0.9-cpu"]
    assert run(build_parser().parse_args(["runtime", "update", "sftoy"])) == 0
    assert "installed sftoy 1.0-cpu (1.0, cpu) - the default" in capsys.readouterr().out
    assert _home.current("sftoy") == "1.0-cpu" and _home.pinned("sftoy") == "1.0-cpu"
    assert _home.installs("sftoy") == ["0.9-cpu", "1.0-cpu"]
