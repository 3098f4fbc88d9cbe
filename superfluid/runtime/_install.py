"""Installing a runtime: plan -> fetch -> verify -> stage -> unpack -> check -> switch.

An install is built in a hidden staging directory next to its target
(``runtimes/<id>/.staging-<install>-<token>/``), which is never an install: only the last
step renames it into place and then points ``current`` at it (one symlink rename). So
whatever stops an install -- Ctrl-C, a failed step, a killed process -- the installs
that were there stay as they were and nothing half-made is ever ``ready``. A stopped
install removes its staging directory (shielded, bounded); a killed one leaves it, and
the next runtime command or ``serve`` removes it (:func:`superfluid.runtime._home.cleanup`).

One install, update, repair, remove or use per runtime at a time, across processes: an
``flock`` on ``runtimes/<id>/.lock``; a second one waits for it (cancellably).

Two kinds:

* ``archive`` (``--from URL|PATH``, or a pinned release): one archive, fetched over
  https (plain http only from a loopback host) or copied from a local path, checked
  against a SHA-256 known before the fetch, unpacked with :mod:`._archive`'s rules; its
  worker is ``bin/superfluid-worker-<id>``.
* ``venv`` (a Python runtime with pinned packages): a private virtual environment made by
  ``python -m venv`` (or ``uv``), then ``pip install --require-hashes --no-deps`` (binary
  only where a wheel exists) from the package index; its interpreter starts
  ``python -m superfluid.worker``, finding superfluid through a ``.pth`` file placed after
  its own site-packages (the install's packages win).

Credentials: pip and the check start from an environment without credential-named
variables (pip keeps its network settings), and every line written to the install log
has URL credentials and the values of credential variables masked.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

import trio

from .._errors import leaves
from . import _home
from ._archive import UnsafeArchive, unpack
from ._registry import Package, RuntimeInfo, get
from ._status import daemon_paths, run_check

__all__ = ["ARCHIVE_STEPS", "InstallError", "Plan", "Progress", "VENV_STEPS", "install", "make_plan", "remove",
           "repair", "use", "verify"]

ARCHIVE_STEPS = ("plan", "fetch", "verify", "stage", "unpack", "check", "switch")
VENV_STEPS = ("plan", "stage", "fetch", "verify", "check", "switch")
CHUNK = 1 << 20
FETCH_TIMEOUT_S = 60.0
PIP_TIMEOUT_S = 3600.0     # a source build on a slow machine
CHECK_TIMEOUT_S = 120.0
CLEANUP_TIMEOUT_S = 30.0
LOCK_POLL_S = 0.2
HEARTBEAT_S = 1.0
MAX_ARCHIVE_BYTES = 8 << 30
_OWN_NAMES = frozenset({".download", "install.log", _home.RECORD})  # what an archive's top level may not name

Hook = Callable[[str], Awaitable[None]]

_CRED_RE = re.compile(r"((^|_)(TOKEN|API_?KEY|KEY|CREDENTIALS?)$)|PASSWORD|PASSWD|SECRET", re.I)
# what pip keeps of the caller's environment besides the basics: its network settings
_PIP_KEEP = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_CERT", "PIP_CLIENT_CERT",
             "PIP_PROXY", "PIP_TIMEOUT", "PIP_RETRIES", "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR")


class InstallError(Exception):
    """An install that did not happen, in one line. ``usage``: refused before anything was
    fetched because of how it was asked (exit 2), else a failure on the way (exit 1)."""

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


class Progress:
    """What an install reports as it goes (the CLI draws it on a terminal)."""

    def step(self, index: int, total: int, name: str, detail: str) -> None:
        pass

    def advance(self, done: int, total: int | None) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def tick(self, elapsed_s: float) -> None:
        pass

    def phase(self, text: str) -> None:
        """Where a long step is now (pip: downloading, building X from source, installing);
        the step's raw output goes to the install log, not here."""


# pip's (and uv's) output lines that start a phase of the fetch step, and what the phase is called
_PIP_PHASES = (
    (re.compile(r"^\s*(?:Collecting|Downloading|Obtaining)\s+(\S+)"), "downloading {}"),
    (re.compile(r"^\s*(?:Installing build dependencies|Getting requirements to build|Preparing metadata)"),
     "preparing the build"),
    (re.compile(r"^\s*Building wheels? for (?:collected packages: )?([\w.-]+)"),
     "building {} from source (a C/C++ compile: minutes)"),
    (re.compile(r"^\s*Building ([\w.-]+)==\S+"), "building {} from source (a C/C++ compile: minutes)"),  # uv
    (re.compile(r"^\s*(?:Installing collected packages|Installed \d+ package|Prepared \d+ package)"), "installing"),
)


def pip_phase(line: str) -> str | None:
    """The phase a line of pip's or uv's output starts, or None."""
    for pattern, name in _PIP_PHASES:
        m = pattern.match(line)
        if m:
            return name.format(*m.groups())
    return None


@dataclass
class Artifact:
    source: str              # an https:// (or loopback http://) URL, or a local path
    sha256: str | None       # known before the fetch; None only for a local path (a warning)
    name: str


@dataclass
class Plan:
    info: RuntimeInfo
    install: str             # the directory name: <version>-<backend>
    version: str
    backend: str
    kind: str                # "archive" | "venv"
    artifacts: list[Artifact] = field(default_factory=list)
    packages: tuple[Package, ...] = ()
    index: str | None = None
    build_env: dict[str, str] = field(default_factory=dict)
    replace: bool = False    # reinstall over an install of the same name (repair)
    make_default: bool = False  # update: the new install becomes the default, pinned or not
    warnings: list[str] = field(default_factory=list)
    request: dict[str, Any] = field(default_factory=dict)  # how it was asked (repair asks again)

    @property
    def rid(self) -> str:
        return self.info.id

    @property
    def steps(self) -> tuple[str, ...]:
        return ARCHIVE_STEPS if self.kind == "archive" else VENV_STEPS

    @property
    def target(self) -> Path:
        return _home.runtime_dir(self.rid) / self.install

    def lines(self) -> list[str]:
        """The plan, as ``--dry-run`` prints it."""
        out = [f"install {self.rid} {self.install} (version {self.version}, backend {self.backend}, {self.kind})",
               f"  into     {self.target}" + ("  (replacing it)" if self.replace else "")]
        for a in self.artifacts:
            out.append(f"  fetch    {redact(a.source)}")
            out.append(f"  verify   sha256 {a.sha256}" if a.sha256 else "  verify   (no SHA-256: a local file, "
                                                                             "installed unverified)")
        if self.kind == "venv":
            tool = "uv" if shutil.which("uv") else f"{Path(sys.executable).name} -m venv + pip"
            out.append(f"  stage    a private environment ({tool}), Python {sys.version.split()[0]}")
            out.append(f"  fetch    from {redact(self.index or '')} with --require-hashes --no-deps:")
            for p in self.packages:
                how = "wheel" if p.binary else "source (pip's wheel cache keeps the build)"
                out.append(f"             {p.name}=={p.version}  {how}  sha256 {', '.join(h[:16] + '…' for h in p.sha256)}")
            for key, value in self.build_env.items():
                out.append(f"  build    {key}={value}")
        out.append(f"  check    {self.rid}'s worker check in the staged install")
        out.append(f"  switch   {self.rid}/current -> {self.install}" + ("" if self.make_default else
                                                                         " (if it ranks first and nothing is pinned)"))
        out += [f"  warning  {w}" for w in self.warnings]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"runtime": self.rid, "install": self.install, "version": self.version, "backend": self.backend,
                "kind": self.kind, "target": str(self.target), "steps": list(self.steps),
                "artifacts": [{**asdict(a), "source": redact(a.source)} for a in self.artifacts],
                "packages": [asdict(p) for p in self.packages], "index": redact(self.index or "") or None,
                "warnings": self.warnings}


# -- URLs and credentials -------------------------------------------------------------------


def _loopback(host: str | None) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def url_refusal(url: str) -> str | None:
    """Why ``url`` may not be fetched (https only; plain http from a loopback host), or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return None
    if parts.scheme == "http" and _loopback(parts.hostname):
        return None
    return f"{redact(url)}: installs fetch over https:// only"


def _is_url(source: str) -> bool:
    return "://" in source


def _credential_values() -> list[str]:
    return [v for k, v in os.environ.items() if _CRED_RE.search(k) and len(v) >= 6]


def redact(text: str) -> str:
    """``text`` without URL credentials or the values of credential-named variables."""
    text = re.sub(r"(?<=://)[^/@\s]+@", "***@", text)
    for value in _credential_values():
        text = text.replace(value, "***")
    return text


def _scrubbed_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _CRED_RE.search(k)}


def _pip_env() -> dict[str, str]:
    """pip's environment: no credential variables, none of the caller's PYTHON*/PIP_* settings
    but pip's network ones, no user pip configuration."""
    env = {k: v for k, v in os.environ.items()
           if not _CRED_RE.search(k) and not k.startswith(("PYTHON", "PIP_")) and k != "VIRTUAL_ENV"}
    env.update({k: os.environ[k] for k in _PIP_KEEP if k in os.environ})
    env.update({"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
                "PYTHONNOUSERSITE": "1"})
    return env


# -- planning -------------------------------------------------------------------------------


def make_plan(rid: str, *, version: str | None = None, backend: str | None = None, from_: str | None = None,
              sha256: str | None = None, untested: bool = False, replace: bool = False,
              make_default: bool = False, info: RuntimeInfo | None = None) -> Plan:
    """What ``runtime install`` would do, decided before anything is fetched.

    Raises:
        UnknownRuntime: ``rid`` names no runtime.
        InstallError: (usage) the install cannot be planned as asked.
    """
    info = info or get(rid)
    request = {"version": version, "backend": backend, "from": from_, "sha256": sha256, "untested": untested}
    if info.builtin:
        raise InstallError(f"runtime {info.id} is built in: there is nothing to install", usage=True)
    if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise InstallError(f"--sha256 {sha256!r}: expected 64 hexadecimal digits", usage=True)
    name_ok = _home.valid_name
    if from_ is not None:
        warnings = []
        if _is_url(from_):
            why = url_refusal(from_)
            if why is not None:
                raise InstallError(why, usage=True)
            if sha256 is None:
                raise InstallError(f"{redact(from_)}: an archive from elsewhere needs a SHA-256 to check it "
                                   "against (pass --sha256 H)", usage=True)
            name = Path(urllib.parse.urlsplit(from_).path).name or "archive"
        else:
            path = Path(from_).expanduser()
            if not path.is_file():
                raise InstallError(f"--from {from_}: no such file", usage=True)
            from_ = str(path.resolve())
            name = path.name
            if sha256 is None:
                warnings.append(f"{from_} has no --sha256: installed as it is, unverified")
        version = version or "custom"
        backend = backend or "cpu"
        install_name = f"{version}-{backend}"
        if not name_ok(install_name):
            raise InstallError(f"--version {version} --backend {backend}: not a usable install name", usage=True)
        return Plan(info, install_name, version, backend, "archive",
                    artifacts=[Artifact(from_, sha256.lower() if sha256 else None, name)],
                    replace=replace, make_default=make_default, warnings=warnings, request=request)
    why = info.platforms()
    if why is not None:
        raise InstallError(f"runtime {info.id} {why}", usage=True)
    source = info.source
    if source is None:
        raise InstallError(f"runtime {info.id} has no pinned build to install: pass --from URL|PATH with "
                           "--sha256 H and --version V", usage=True)
    if sha256 is not None:
        raise InstallError("--sha256 goes with --from (the packages of a Python runtime are pinned)", usage=True)
    if version not in (None, source.version):
        more = "" if untested else " (another version needs --from with --sha256)"
        raise InstallError(f"runtime {info.id}: the tested version is {source.version}; no pinned hashes for "
                           f"{version}{more}", usage=True)
    backend = backend or source.backends[0]
    if backend not in source.backends:
        raise InstallError(f"runtime {info.id} has no {backend!r} backend (it has {', '.join(source.backends)})",
                           usage=True)
    return Plan(info, f"{source.version}-{backend}", source.version, backend, "venv", packages=source.packages,
                index=source.index, build_env=dict(source.build_env.get(backend, {})), replace=replace,
                make_default=make_default, request=request)


# -- running --------------------------------------------------------------------------------


@asynccontextmanager
async def _one_error() -> AsyncIterator[None]:
    """A nursery's lone exception as itself (an install has one failure to tell)."""
    try:
        yield
    except BaseExceptionGroup as group:
        failures = leaves(group)
        if len(failures) == 1:
            raise failures[0] from None
        raise


class _Log:
    """The install log (0600, in the staging directory, so it moves with the install):
    every line redacted."""

    def __init__(self, path: Path) -> None:
        self.file: IO[str] = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "w")

    def write(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        for line in text.splitlines() or [""]:
            self.file.write(f"{stamp} {redact(line)}\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


async def _locked(rid: str, progress: Progress) -> int:
    """Wait (cancellably) for the runtime's lock; return its fd."""
    told = False
    while True:
        try:
            return _home.acquire_lock(rid)
        except _home.LockBusy as busy:
            if not told:
                progress.note(f"another install of {rid} is running (pid {busy.pid}); waiting for it")
                told = True
        await trio.sleep(LOCK_POLL_S)


async def _run_logged(argv: list[str], *, env: dict[str, str], log: _Log, progress: Progress,
                      phases: Callable[[str], str | None] | None = None) -> int:
    """Run ``argv`` with its output in the log only (``phases`` names the phases its lines
    start, for the progress display); cancellation kills it (trio's SIGTERM, then SIGKILL).
    The caller bounds its time."""
    log.write("$ " + " ".join(argv))
    run = partial(trio.run_process, argv, env=env, stdin=None, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  check=False)
    async with _one_error(), trio.open_nursery() as nursery:
        proc = await nursery.start(run)
        assert proc.stdout is not None
        buf = b""
        current = None
        async for chunk in proc.stdout:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").rstrip()
                log.write(line)
                now = phases(line) if phases is not None else None
                if now is not None and now != current:
                    current = now
                    progress.phase(redact(now))
        if buf:
            log.write(buf.decode(errors="replace"))
        rc = await proc.wait()
    return int(rc)


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        why = url_refusal(newurl)
        if why is not None:
            raise urllib.error.HTTPError(newurl, code, f"redirect refused: {why}", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _open_source(artifact: Artifact) -> tuple[Any, int | None]:
    """The artifact's byte stream and its size if known (a thread: this blocks)."""
    if not _is_url(artifact.source):
        f = open(artifact.source, "rb")  # noqa: SIM115 - the caller closes it
        return f, os.fstat(f.fileno()).st_size
    opener = urllib.request.build_opener(_NoDowngrade())
    request = urllib.request.Request(artifact.source, headers={"User-Agent": "superfluid"})
    response = opener.open(request, timeout=FETCH_TIMEOUT_S)
    return response, int(response.headers.get("Content-Length") or 0) or None


def _copy_chunk(src: Any, out: IO[bytes], digest: Any) -> int:
    chunk = src.read(CHUNK)
    digest.update(chunk)
    out.write(chunk)
    return len(chunk)


async def _fetch(artifact: Artifact, into: Path, progress: Progress, log: _Log) -> str:
    """Download or copy one artifact into ``into``, a chunk per thread call (so a cancel
    lands between chunks); return its SHA-256 (hex)."""
    digest = hashlib.sha256()
    done = 0
    log.write(f"fetch {artifact.source}")
    where = redact(artifact.source)
    try:
        src, total = await trio.to_thread.run_sync(_open_source, artifact, abandon_on_cancel=True)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InstallError(f"fetch {where}: {redact(str(exc))}") from None
    try:
        out = await trio.to_thread.run_sync(lambda: os.fdopen(os.open(into, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                                                      0o600), "wb"))
        try:
            while True:
                try:
                    n = await trio.to_thread.run_sync(_copy_chunk, src, out, digest)
                except OSError as exc:
                    raise InstallError(f"fetch {where}: {redact(str(exc))}") from None
                if not n:
                    break
                done += n
                if done > MAX_ARCHIVE_BYTES:
                    raise InstallError(f"fetch {where}: larger than {MAX_ARCHIVE_BYTES} bytes")
                progress.advance(done, total)
        finally:
            out.close()
    finally:
        src.close()
    log.write(f"fetched {done} bytes, sha256 {digest.hexdigest()}")
    return digest.hexdigest()


def _manifest(root: Path) -> dict[str, str]:
    """SHA-256 of every file of an install (symlinks by target), but its log, its record and
    Python's byte-code caches."""
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and d != ".download")
        for name in sorted(filenames) + [d for d in os.listdir(dirpath) if os.path.islink(os.path.join(dirpath, d))
                                         and os.path.isdir(os.path.join(dirpath, d))]:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel in (_home.RECORD, "install.log"):
                continue
            if path.is_symlink():
                files[rel] = "link:" + os.readlink(path)
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
            files[rel] = h.hexdigest()
    return files


def _have_pip() -> bool:
    import importlib.util

    return importlib.util.find_spec("pip") is not None


def _site_packages(env: Path) -> Path:
    return env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class _Run:
    """One install in its staging directory (state shared by the steps)."""

    def __init__(self, plan: Plan, staging: Path, log: _Log, progress: Progress, hook: Hook | None) -> None:
        self.plan = plan
        self.staging = staging
        self.log = log
        self.progress = progress
        self.hook = hook
        self.downloads: list[tuple[Artifact, Path, str]] = []
        self.report: dict[str, Any] = {}

    async def enter(self, name: str, detail: str = "") -> None:
        steps = self.plan.steps
        self.log.write(f"-- {name} {detail}")
        self.progress.step(steps.index(name) + 1, len(steps), name, detail)
        if self.hook is not None:
            await self.hook(name)

    # archive steps

    async def fetch(self) -> None:
        download = self.staging / ".download"
        download.mkdir(mode=0o700)
        for artifact in self.plan.artifacts:
            await self.enter("fetch", redact(artifact.source))
            path = download / (artifact.name or "archive")
            self.downloads.append((artifact, path, await _fetch(artifact, path, self.progress, self.log)))

    async def verify(self) -> None:
        await self.enter("verify", "sha256")
        for artifact, _path, got in self.downloads:
            if artifact.sha256 is None:
                self.progress.note(f"warning: {artifact.source} installed unverified (sha256 {got})")
            elif got != artifact.sha256:
                raise InstallError(f"{redact(artifact.source)}: sha256 {got} is not the expected "
                                   f"{artifact.sha256}; nothing was installed")

    async def stage_archive(self) -> None:
        await self.enter("stage", str(self.staging.name))
        (self.staging / "bin").mkdir(mode=0o755, exist_ok=True)

    async def unpack(self) -> None:
        await self.enter("unpack")
        for _artifact, path, _got in self.downloads:
            tree = self.staging / ".download" / "tree"
            tree.mkdir()
            try:
                await trio.to_thread.run_sync(partial(unpack, path, tree, check=trio.from_thread.check_cancelled))
            except UnsafeArchive as exc:
                raise InstallError(f"unsafe archive {path.name}: {exc}; nothing was installed") from None
            except Exception as exc:  # noqa: BLE001 - tarfile/zipfile raise many types: one line says which
                raise InstallError(f"cannot unpack {path.name}: {type(exc).__name__}: {exc}") from None
            top = list(tree.iterdir())
            if len(top) == 1 and top[0].is_dir() and not (tree / "bin").exists():
                tree = top[0]  # one top-level directory (name-1.2/...): its content is the install
            for entry in tree.iterdir():
                if entry.name in _OWN_NAMES:  # the staging directory's own: the log, the download, the record
                    raise InstallError(f"unsafe archive {path.name}: member {entry.name!r} would replace the "
                                       "install's own; nothing was installed")
                dest = self.staging / entry.name
                try:
                    if dest.is_dir() and entry.is_dir() and not any(dest.iterdir()):
                        dest.rmdir()
                    os.rename(entry, dest)
                except OSError as exc:
                    raise InstallError(f"cannot unpack {path.name}: {entry.name!r}: {exc.strerror}") from None
        worker = self.staging / "bin" / f"superfluid-worker-{self.plan.rid}"
        if not (worker.is_file() and os.access(worker, os.X_OK)):
            raise InstallError(f"the archive has no executable bin/superfluid-worker-{self.plan.rid}")

    # venv steps

    async def stage_venv(self) -> None:
        await self.enter("stage", "a private environment")
        env = self.staging / "env"
        uv = shutil.which("uv")
        if uv:
            argv = [uv, "venv", "--quiet", "--python", sys.executable, str(env)]
        else:  # pip runs from superfluid's environment (--python); a pip of its own only if there is none
            argv = [sys.executable, "-m", "venv", *(["--without-pip"] if _have_pip() else []), str(env)]
        with trio.fail_after(300):
            rc = await _run_logged(argv, env=_pip_env(), log=self.log, progress=self.progress)
        if rc != 0:
            raise InstallError(f"could not make the environment (exit {rc}); see {_failed_log(self.plan)}")
        site = _site_packages(env)
        if not site.is_dir():
            raise InstallError(f"the new environment has no {site}")

    async def fetch_packages(self) -> None:
        plan = self.plan
        await self.enter("fetch", f"{len(plan.packages)} packages from {redact(plan.index or '')}")
        reqs = self.staging / "requirements.txt"
        reqs.write_text("".join(p.requirement() + "\n" for p in plan.packages), encoding="utf-8")
        binary = [p.name for p in plan.packages if p.binary]
        source = [p.name for p in plan.packages if not p.binary]
        python = str(self.staging / "env" / "bin" / "python")
        uv = shutil.which("uv")
        if uv:
            base = [uv, "pip", "install", "--python", python]
        elif _have_pip():
            base = [sys.executable, "-m", "pip", "--python", python, "install", "--progress-bar", "off"]
        else:
            base = [python, "-m", "pip", "install", "--progress-bar", "off"]
        argv = [*base, "--require-hashes", "--no-deps", "--index-url", plan.index or "", "-r", str(reqs)]
        if binary:
            argv += ["--only-binary", ",".join(binary)]
        if source:
            argv += ["--no-binary", ",".join(source)]
        if plan.build_env:
            argv.append("--no-cache-dir")  # a build for another backend: never pip's cached CPU build
        env = {**_pip_env(), **plan.build_env}
        if source:
            self.progress.note(f"{', '.join(source)} builds from source: a C/C++ compiler and cmake, some minutes")
        self.progress.note(f"pip's output: {self.staging / 'install.log'} (then {plan.target / 'install.log'})")
        with trio.fail_after(PIP_TIMEOUT_S):
            rc = await _run_logged(argv, env=env, log=self.log, progress=self.progress, phases=pip_phase)
        if rc != 0:
            tail = [line for line in self._log_tail() if line.strip()]
            raise InstallError(f"pip could not install {plan.rid}'s packages (exit {rc}): "
                               f"{tail[-1] if tail else 'no output'}; pip's output is in {_failed_log(plan)}")

    def _log_tail(self) -> list[str]:
        try:
            return (self.staging / "install.log").read_text(errors="replace").splitlines()[-20:]
        except OSError:
            return []

    async def verify_packages(self) -> None:
        await self.enter("verify", "installed versions")
        site = _site_packages(self.staging / "env")
        found = {}
        for dist in site.glob("*.dist-info"):
            stem = dist.name[: -len(".dist-info")]
            name, _, version = stem.rpartition("-")
            found[re.sub(r"[-_.]+", "-", name).lower()] = version
        for p in self.plan.packages:
            got = found.get(re.sub(r"[-_.]+", "-", p.name).lower())
            if got != p.version:
                raise InstallError(f"{p.name}=={p.version} is not in the new environment (found {got})")
        # superfluid's worker side, after the install's own packages (written after pip ran, so
        # pip never mistakes superfluid's environment for the install's)
        (site / "superfluid-daemon.pth").write_text("\n".join(daemon_paths()) + "\n", encoding="utf-8")

    # both

    def _command(self) -> tuple[str, ...]:
        if self.plan.kind == "venv":
            return (str(self.staging / "env" / "bin" / "python"), "-m", "superfluid.worker")
        return (str(self.staging / "bin" / f"superfluid-worker-{self.plan.rid}"),)

    async def check(self) -> None:
        await self.enter("check", "the worker's check")
        env = _scrubbed_env()
        env.pop("PYTHONPATH", None)   # the install must find superfluid itself
        env.pop("PYTHONHOME", None)
        env["PYTHONNOUSERSITE"] = "1"
        modules = self.plan.info.requires
        report = await trio.to_thread.run_sync(
            lambda: run_check(self._command(), self.plan.rid, modules, env=env), abandon_on_cancel=True)
        self.log.write("check: " + json.dumps(report))
        if not report.get("available"):
            raise InstallError(f"the staged {self.plan.rid} failed its check: {report.get('error')}")
        if report.get("runtime") not in (self.plan.rid, None):
            raise InstallError(f"the staged worker says it is runtime {report.get('runtime')!r}, "
                               f"not {self.plan.rid}")
        if self.plan.kind == "venv":
            outside = _imported_from_outside(report, modules, self.staging / "env")
            if outside:
                raise InstallError(f"the staged environment imports {outside}, not from itself")
        self.report = report

    async def switch(self) -> dict[str, Any]:
        plan = self.plan
        await self.enter("switch", f"{plan.rid}/current -> {plan.install}")
        shutil.rmtree(self.staging / ".download", ignore_errors=True)
        with trio.CancelScope(shield=True):  # from here the install is placed whole or not at all
            files = await trio.to_thread.run_sync(_manifest, self.staging)
            venv = plan.kind == "venv"
            record = {
                "id": plan.rid, "install": plan.install, "version": plan.version, "backend": plan.backend,
                "device": plan.backend, "formats": list(plan.info.formats), "kind": plan.kind,
                "interpreter": "env/bin/python" if venv else None,
                "worker": None if venv else f"bin/superfluid-worker-{plan.rid}",
                "sources": [{"source": redact(a.source), "sha256": a.sha256 or got}
                            for a, _p, got in self.downloads],
                "packages": [asdict(p) for p in plan.packages], "index": redact(plan.index or "") or None,
                "check_modules": list(plan.info.requires), "links": daemon_paths() if venv else None,
                "check": self.report, "files": files, "request": plan.request,
                "installed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            self.log.write(f"placing {plan.install} ({len(files)} files)")
            await trio.to_thread.run_sync(_fsync_tree, self.staging)
            _write_json(self.staging / _home.RECORD, record)
            target = plan.target
            if target.exists():
                old = target.with_name(f"{_home.OLD}{plan.install}-{secrets.token_hex(4)}")
                os.rename(target, old)
                os.rename(self.staging, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(self.staging, target)
            _choose_default(plan.rid, plan.install if plan.make_default else None)
        return record


def _imported_from_outside(report: dict[str, Any], modules: tuple[str, ...], env: Path) -> str | None:
    inside = str(env.resolve())
    for name, mod in (report.get("modules") or {}).items():
        file = mod.get("file")
        if name in modules and file and not str(Path(file).resolve()).startswith(inside):
            return f"{name} from {file}"
    return None


def _ready_records(rid: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name in _home.installs(rid):
        try:
            out[name] = _home.read_record(rid, name)
        except (OSError, ValueError):
            continue
    return out


def _choose_default(rid: str, make: str | None = None) -> str | None:
    """Point ``current`` at ``make`` (re-pinning it if a pin exists), else at the pinned
    install, else at the best-ranked ready one."""
    records = _ready_records(rid)
    if make is not None:
        if _home.pinned(rid) is not None:
            _home.set_pinned(rid, make)
        _home.switch_current(rid, make)
        return make
    pin = _home.pinned(rid)
    if pin is not None and pin in records:
        _home.switch_current(rid, pin)
        return pin
    best = max(records, key=lambda n: _home.rank_key(records[n]), default=None)
    _home.switch_current(rid, best)
    return best


async def install(plan: Plan, *, progress: Progress | None = None, hook: Hook | None = None) -> dict[str, Any]:
    """Carry out ``plan``; return the new install's record.

    The steps run in their own nursery. Cancellation (Ctrl-C) or any failure removes the
    staging directory (shielded, bounded) and leaves the installs as they were.

    Raises:
        InstallError: a step failed (one line).
    """
    progress = progress or Progress()
    rid = plan.rid
    fd = await _locked(rid, progress)
    try:
        for line in _home.cleanup(rid):
            progress.note(f"cleaned up after an interrupted install: {line}")
        if plan.target.exists() and not plan.replace:
            try:
                record = _home.read_record(rid, plan.install)
            except (OSError, ValueError):
                raise InstallError(f"{rid} {plan.install} is there but broken: run "
                                   f"`superfluid runtime repair {rid} {plan.install}`") from None
            _choose_default(rid, plan.install if plan.make_default else None)
            progress.note(f"{rid} {plan.install} is already installed")
            return record
        staging = _home.runtime_dir(rid) / f"{_home.STAGING}{plan.install}-{secrets.token_hex(4)}"
        os.mkdir(staging, 0o700)
        log = _Log(staging / "install.log")
        run = _Run(plan, staging, log, progress, hook)
        result: dict[str, Any] = {}
        try:
            log.write(f"superfluid runtime install: {json.dumps(plan.to_json())}")

            async def steps() -> None:
                await run.enter("plan", plan.install)
                if plan.kind == "archive":
                    await run.fetch()
                    await run.verify()
                    await run.stage_archive()
                    await run.unpack()
                else:
                    await run.stage_venv()
                    await run.fetch_packages()
                    await run.verify_packages()
                await run.check()
                result.update(await run.switch())

            async def heartbeat() -> None:
                while True:  # a long step (a source build) still shows it is alive
                    await trio.sleep(HEARTBEAT_S)
                    progress.tick(time.monotonic() - started)

            started = time.monotonic()
            async with _one_error(), trio.open_nursery() as nursery:
                nursery.start_soon(heartbeat)
                await steps()
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            log.write(f"install stopped: {type(exc).__name__}: {exc}")
            with suppress(OSError):  # the log outlives the staging directory: it says why
                os.replace(staging / "install.log", _failed_log(plan))
            with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT_S):
                await trio.to_thread.run_sync(shutil.rmtree, staging, True)
            raise
        finally:
            log.close()
        return result
    finally:
        _home.release_lock(fd)


def _failed_log(plan: Plan) -> Path:
    """Where a failed install's log is kept (one per install name; a file is never an install)."""
    return _home.runtime_dir(plan.rid) / f"install-{plan.install}.failed.log"


async def _with_lock(rid: str, progress: Progress | None, fn: Callable[[], Any]) -> Any:
    fd = await _locked(rid, progress or Progress())
    try:
        _home.cleanup(rid)
        return fn()
    finally:
        _home.release_lock(fd)


def verify(rid: str, name: str) -> list[str]:
    """What differs in an install from its record (and its worker's check): [] when intact."""
    try:
        record = _home.read_record(rid, name)
    except (OSError, ValueError) as exc:
        return [f"{_home.RECORD} unreadable: {exc}"]
    root = _home.runtime_dir(rid) / name
    now = _manifest(root)
    problems = [f"{rel} differs" if rel in now else f"{rel} is missing"
                for rel, digest in record.get("files", {}).items() if now.get(rel) != digest]
    if len(problems) > 5:
        problems = [*problems[:5], f"and {len(problems) - 5} more files"]
    if record.get("links") is not None and record["links"] != daemon_paths():
        problems.append("made for another superfluid environment")
    if not problems:
        command = (str(root / record["interpreter"]), "-m", "superfluid.worker") if record.get("interpreter") \
            else (str(root / record["worker"]),)
        report = run_check(command, rid, tuple(record.get("check_modules", ())))
        if not report.get("available"):
            problems.append(f"the worker's check fails: {report.get('error')}")
    return problems


def _request_of(rid: str, name: str) -> dict[str, Any]:
    try:
        return dict(_home.read_record(rid, name).get("request") or {})
    except (OSError, ValueError):
        version, _, backend = name.rpartition("-")
        return {"version": version or None, "backend": backend or None}


async def repair(rid: str, name: str | None = None, *, progress: Progress | None = None,
                 hook: Hook | None = None) -> tuple[str, list[str]]:
    """Re-verify an install (default: the default one) and reinstall it if anything differs.
    Returns (install, the problems it had: [] if it was intact).

    Raises:
        InstallError
    """
    info = get(rid)
    rid = info.id
    name = name or _home.pinned(rid) or _home.current(rid)
    if name is None or name not in _home.installs(rid):
        raise InstallError(f"runtime {rid} has no install {name!r} to repair (installs: "
                           f"{', '.join(_home.installs(rid)) or 'none'})", usage=True)
    problems = await trio.to_thread.run_sync(verify, rid, name)
    if not problems:
        return name, []
    req = _request_of(rid, name)
    plan = make_plan(rid, version=req.get("version"), backend=req.get("backend"), from_=req.get("from"),
                     sha256=req.get("sha256"), untested=bool(req.get("untested")), replace=True, info=info)
    if plan.install != name:
        raise InstallError(f"cannot repair {rid} {name}: it was not made by `superfluid runtime install`; "
                           f"remove it", usage=True)
    await install(plan, progress=progress, hook=hook)
    return name, problems


async def remove(rid: str, name: str | None = None, *, progress: Progress | None = None) -> list[str]:
    """Remove one install (or all of them); the default moves to the best remaining one.
    Returns the names removed.

    Raises:
        InstallError
    """
    rid = get(rid).id

    def work() -> list[str]:
        names = _home.installs(rid)
        if name is not None and name not in names:
            raise InstallError(f"runtime {rid} has no install {name!r} (installs: {', '.join(names) or 'none'})",
                               usage=True)
        gone = [name] if name is not None else names
        base = _home.runtime_dir(rid)
        for n in gone:
            trash = base / f"{_home.OLD}{n}-{secrets.token_hex(4)}-removed"
            os.rename(base / n, trash)
            shutil.rmtree(trash, ignore_errors=True)
        if _home.pinned(rid) in gone:
            _home.set_pinned(rid, None)
        _choose_default(rid)
        return gone

    return await _with_lock(rid, progress, work)  # type: ignore[no-any-return]


async def use(rid: str, name: str | None, *, progress: Progress | None = None) -> str | None:
    """Pin ``name`` as the default install, or (None) unpin and rank. Returns the default.

    Raises:
        InstallError
    """
    rid = get(rid).id

    def work() -> str | None:
        if name is None:
            _home.set_pinned(rid, None)
            return _choose_default(rid)
        if name not in _home.installs(rid):
            raise InstallError(f"runtime {rid} has no install {name!r} (installs: "
                               f"{', '.join(_home.installs(rid)) or 'none'})", usage=True)
        try:
            _home.read_record(rid, name)
        except (OSError, ValueError):
            raise InstallError(f"{rid} {name} is broken: run `superfluid runtime repair {rid} {name}`") from None
        _home.set_pinned(rid, name)
        _home.switch_current(rid, name)
        return name

    return await _with_lock(rid, progress, work)  # type: ignore[no-any-return]


def fault_hook(spec: str | None) -> Hook | None:
    """A hook from ``SUPERFLUID_INSTALL_FAULT=<step>:<kill|interrupt|fail>`` (tests: a
    process killed, or Ctrl-C, or a failure, as it enters that step)."""
    if not spec:
        return None
    step, _, action = spec.partition(":")

    async def hook(name: str) -> None:
        await trio.lowlevel.checkpoint()
        if name != step:
            return
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "interrupt":
            raise KeyboardInterrupt
        raise InstallError(f"injected failure at {name}")

    return hook
