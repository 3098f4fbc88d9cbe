"""Which worker runs a runtime, and the state of every runtime and install.

How a worker is found, first match wins:

1. ``SUPERFLUID_WORKER_<ID>`` names an executable (it takes the arguments of
   ``python -m superfluid.worker``); never installed, never checked here.
2. ``--runtime ID@INSTALL``: exactly that install.
3. the in-process environment: the daemon's own Python holds what the runtime needs
   (the ``[llamacpp]`` extra, or a built-in runtime).
4. the install ``current`` points to: its private interpreter starts the worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._private import scrub_env
from . import _home
from ._registry import RUNTIMES, RuntimeInfo, get

__all__ = ["IN_PROCESS", "InstallState", "RuntimeUnavailable", "daemon_paths", "env_var", "install_command",
           "states", "worker_command"]

IN_PROCESS = "in-process"  # the name the in-process environment goes by in `runtimes` and ID@INSTALL
CHECK_TIMEOUT_S = 60.0


class RuntimeUnavailable(Exception):
    """No worker can run this runtime here; the message is one line that says what to do.
    ``installable``: the runtime has no install at all and ``runtime install`` would make one."""

    def __init__(self, message: str, *, installable: bool = False) -> None:
        super().__init__(message)
        self.installable = installable


def env_var(rid: str) -> str:
    return "SUPERFLUID_WORKER_" + rid.upper().replace("-", "_").replace(".", "_")


def install_command(rid: str) -> str:
    """The command that installs ``rid`` here (with the flags it cannot do without)."""
    info = get(rid)
    if info.source is None and not info.builtin:
        return f"superfluid runtime install {info.id} --from URL --sha256 H --version V"
    return f"superfluid runtime install {info.id}"


def daemon_paths() -> list[str]:
    """What a private environment adds after its own site-packages so that its interpreter can
    start ``superfluid.worker``: superfluid's root, then this environment's site-packages."""
    import superfluid

    root = str(Path(superfluid.__file__).resolve().parent.parent)
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([root, paths["purelib"], paths["platlib"]]))


def _in_process(info: RuntimeInfo) -> str | None:
    """Why the daemon's own environment cannot run ``info``'s worker, or None if it can."""
    if info.engine is None:
        return f"this build has no {info.id} engine"
    if importlib.util.find_spec(info.engine) is None:
        return f"this build has no {info.id} engine ({info.engine} is missing)"
    for module in info.requires:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            return f"{module} is not importable"
    return info.native()


def _install_interpreter(rid: str, name: str, record: dict[str, Any]) -> tuple[str, ...]:
    base = _home.runtime_dir(rid) / name
    if record.get("interpreter"):
        return (str(base / record["interpreter"]), "-m", "superfluid.worker")
    return (str(base / record["worker"]),)


def _install_problems(rid: str, name: str) -> tuple[dict[str, Any] | None, list[str]]:
    """An install's record and what is wrong with it, by looking (no process started)."""
    try:
        record = _home.read_record(rid, name)
    except (OSError, ValueError) as exc:
        return None, [f"{_home.RECORD} unreadable: {exc}"]
    problems = []
    command = _install_interpreter(rid, name, record)
    if not os.access(command[0], os.X_OK):
        problems.append(f"{command[0]} is missing")
    if record.get("interpreter") and record.get("links") != daemon_paths():
        problems.append("made for another superfluid environment")
    return record, problems


def worker_command(rid: str, install: str | None = None) -> tuple[str, ...]:
    """The command prefix that starts ``rid``'s worker (followed by ``superfluid-worker-<id>
    --model ...``).

    Raises:
        UnknownRuntime: no such runtime.
        RuntimeUnavailable: nothing here runs it; one line with the command that fixes it.
    """
    info = get(rid)
    rid = info.id
    explicit = os.environ.get(env_var(rid))
    if explicit and install is None:
        return (explicit,)
    default = (sys.executable, "-m", "superfluid.worker")
    if install == IN_PROCESS or (install is None and (info.builtin or _in_process(info) is None)):
        why = _in_process(info)
        if why is not None:
            raise RuntimeUnavailable(f"runtime {rid} has no in-process environment: {why}")
        return default
    name = install or _home.pinned(rid) or _home.current(rid)
    if name is None:
        why = _in_process(info)
        if info.engine is not None and importlib.util.find_spec(info.engine) is None:
            raise RuntimeUnavailable(f"runtime {rid} is not available: {why}")
        raise RuntimeUnavailable(f"runtime {rid} is not installed ({why}): run `{install_command(rid)}`",
                                 installable=info.source is not None and info.platforms() is None)
    if name not in _home.installs(rid):
        if install is not None:
            known = ", ".join([*_home.installs(rid), IN_PROCESS]) or "none"
            raise RuntimeUnavailable(f"runtime {rid} has no install {install!r} (installs: {known})")
        raise RuntimeUnavailable(f"runtime {rid}'s default install {name} is missing: run "
                                 f"`superfluid runtime use {rid} --auto` or `{install_command(rid)}`")
    record, problems = _install_problems(rid, name)
    if record is None or problems:
        raise RuntimeUnavailable(f"runtime {rid} install {name} is broken ({'; '.join(problems)}): run "
                                 f"`superfluid runtime repair {rid} {name}`")
    return _install_interpreter(rid, name, record)


@dataclass
class InstallState:
    runtime: str
    install: str | None          # None: the runtime has no install at all
    state: str                   # ready | not installed | broken | missing
    version: str | None = None
    backend: str | None = None
    formats: list[str] = field(default_factory=list)
    device: str | None = None
    worker: str | None = None    # where the worker comes from (a path, or the environment variable)
    default: bool = False
    pinned: bool = False
    problems: list[dict[str, str]] = field(default_factory=list)  # [{"problem", "fix"}]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_check(command: tuple[str, ...], rid: str, modules: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start ``command check superfluid-worker-<rid>`` and return its report (``available``
    false with ``error`` when it did not answer)."""
    argv = [*command, "check", f"superfluid-worker-{rid}", *[f"--import={m}" for m in modules]]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False,
                              env=env if env is not None else scrub_env(os.environ), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"available": False, "error": f"the worker's check did not run: {exc}"}
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        if not isinstance(report, dict):
            raise ValueError(report)
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"available": False, "error": f"the worker's check failed (exit {proc.returncode}): {tail}"}
    if proc.returncode != 0:
        report["available"] = False
    return report


def states(rid: str, *, check: bool = True) -> list[InstallState]:
    """One row per way this runtime can run here (the environment variable, the in-process
    environment, each install), or one ``not installed`` row."""
    info = get(rid)
    rid = info.id
    rows: list[InstallState] = []
    formats = list(info.formats)
    explicit = os.environ.get(env_var(rid))
    default_name = _home.pinned(rid) or _home.current(rid)
    if explicit:
        row = InstallState(rid, env_var(rid), "ready", formats=formats, worker=explicit, default=True)
        if not os.access(explicit, os.X_OK):
            row.state = "missing"
            row.problems.append({"problem": f"{env_var(rid)}={explicit} is not an executable",
                                 "fix": f"unset {env_var(rid)} or point it at a worker"})
        rows.append(row)
    why = _in_process(info)
    if why is None:
        version = None
        if info.builtin:
            from .. import __version__ as version
        elif info.requires:
            try:
                from importlib.metadata import version as dist_version

                version = dist_version({"llama_cpp": "llama-cpp-python", "mlx.core": "mlx"}.get(
                    info.requires[0], info.requires[0]))
            except Exception:  # noqa: BLE001 - a version we cannot name is reported as unknown
                version = None
        rows.append(InstallState(rid, IN_PROCESS, "ready", version=version, backend="cpu", formats=formats,
                                 device="cpu", worker=sys.executable))
    for name in _home.installs(rid):
        record, problems = _install_problems(rid, name)
        row = InstallState(rid, name, "ready", formats=formats, default=False, pinned=_home.pinned(rid) == name)
        if record is not None:
            row.version, row.backend = record.get("version"), record.get("backend")
            row.device = record.get("device")
            row.worker = " ".join(_install_interpreter(rid, name, record))
            if check and not problems:
                report = run_check(_install_interpreter(rid, name, record), rid,
                                   tuple(record.get("check_modules", ())))
                if not report.get("available"):
                    problems.append(str(report.get("error") or "the worker's check failed"))
        if problems:
            row.state = "broken"
            row.problems += [{"problem": p, "fix": f"superfluid runtime repair {rid} {name}"} for p in problems]
        rows.append(row)
    # which row serve would use: the explicit worker, else the in-process environment, else the default install
    chosen = next((r for r in rows if r.install == env_var(rid) or r.install == IN_PROCESS), None)
    if chosen is None:
        chosen = next((r for r in rows if r.install == default_name), None)
    for r in rows:
        r.default = r is chosen
    if default_name and default_name not in _home.installs(rid):
        rows.append(InstallState(rid, default_name, "missing", formats=formats, problems=[
            {"problem": f"the default install {default_name} is gone",
             "fix": f"superfluid runtime use {rid} --auto"}]))
    if not rows:
        reason = info.platforms() or why
        row = InstallState(rid, None, "not installed", formats=formats)
        fix = install_command(rid)
        if info.engine is not None and importlib.util.find_spec(info.engine) is None:
            fix = f"a superfluid whose worker has the {rid} engine ({info.engine})"
        elif info.source is None and info.requires and info.engine is not None:
            fix = (f"install {', '.join(info.requires)} into superfluid's environment, set {env_var(rid)}, "
                   f"or `{install_command(rid)}`")
        row.problems.append({"problem": why or reason or "not installed", "fix": fix})
        rows.append(row)
    return rows


def all_states(*, check: bool = True) -> list[InstallState]:
    return [row for rid in RUNTIMES for row in states(rid, check=check)]
