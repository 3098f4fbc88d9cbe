"""Where installs live, and the small atomic operations on them.

Layout (``$SUPERFLUID_HOME``, default ``~/.superfluid``)::

    runtimes/<id>/
      <install>/            0.3.36-cpu, 1.2.0-cuda ... (a directory is an install only if it
        runtime.json        holds runtime.json: written last, in staging, before the rename)
        install.log
        env/                (Python runtimes) the private virtual environment
        bin/superfluid-worker-<id>   (archive runtimes) the worker executable
      current -> <install>  the default install (a relative symlink, replaced by rename)
      pinned                set by `runtime use`: the install name
      .lock                 one install/update/repair/remove/use of this runtime at a time
      .staging-<install>-*  an install in progress (never an install; removed at the next start)
      .old-<install>-*      an install being replaced or removed (restored or removed at the next start)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._private import make_private_dir

__all__ = [
    "GPU_BACKENDS", "RECORD", "STAGING", "OLD", "LockBusy", "acquire_lock", "cleanup", "current", "home", "installs",
    "pinned", "rank_key", "read_record", "release_lock", "runtime_dir", "set_pinned", "switch_current", "try_lock",
]

RECORD = "runtime.json"
STAGING = ".staging-"
OLD = ".old-"
GPU_BACKENDS = ("metal", "cuda", "rocm", "vulkan", "sycl", "openvino")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")


class LockBusy(Exception):
    """Another process holds the runtime's lock; ``pid`` is what it wrote there (or None)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"held by pid {pid}")
        self.pid = pid


def home() -> Path:
    value = os.environ.get("SUPERFLUID_HOME")
    return Path(value) if value else Path.home() / ".superfluid"


def runtime_dir(rid: str) -> Path:
    return home() / "runtimes" / rid


def valid_name(name: str) -> bool:
    return bool(_NAME_RE.match(name)) and name not in ("current", "pinned")


def installs(rid: str) -> list[str]:
    """Install directory names of a runtime (ready or not), sorted."""
    try:
        entries = list(os.scandir(runtime_dir(rid)))
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries
                  if e.is_dir(follow_symlinks=False) and not e.name.startswith(".") and valid_name(e.name))


def read_record(rid: str, name: str) -> dict[str, Any]:
    """An install's runtime.json.

    Raises:
        OSError, ValueError: missing or unreadable (the install is broken).
    """
    with open(runtime_dir(rid) / name / RECORD, encoding="utf-8") as f:
        record = json.load(f)
    if not isinstance(record, dict) or record.get("id") != rid:
        raise ValueError(f"{RECORD} does not describe runtime {rid}")
    return record


def current(rid: str) -> str | None:
    try:
        return os.readlink(runtime_dir(rid) / "current")
    except OSError:
        return None


def pinned(rid: str) -> str | None:
    try:
        return (runtime_dir(rid) / "pinned").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def switch_current(rid: str, name: str | None) -> None:
    """Point ``current`` at ``name`` (None: remove it) in one rename: a reader sees the old
    link or the new one, never none."""
    base = runtime_dir(rid)
    link = base / "current"
    if name is None:
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        return
    tmp = base / f".current-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, link)
    _fsync_dir(base)


def set_pinned(rid: str, name: str | None) -> None:
    base = runtime_dir(rid)
    if name is None:
        with contextlib.suppress(FileNotFoundError):
            (base / "pinned").unlink()
        return
    tmp = base / f".pinned-{os.getpid()}"
    tmp.write_text(name + "\n", encoding="utf-8")
    os.replace(tmp, base / "pinned")


def _version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"[.\-+_]", version) if part)


def rank_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """Goodness of an install, for ``max``: a GPU backend before cpu, then the newest version."""
    return (record.get("backend") in GPU_BACKENDS, _version_key(str(record.get("version", ""))))


def acquire_lock(rid: str) -> int:
    """Take the runtime's lock at once and return its fd (give it to :func:`release_lock`).
    The kernel drops an ``flock`` with its process, so a killed install never leaves it held.

    Raises:
        LockBusy: another process holds it.
    """
    base = runtime_dir(rid)
    make_private_dir(base)
    fd = os.open(base / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        try:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        except OSError:
            text = ""
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        raise LockBusy(int(text) if text.isdigit() else None) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int) -> None:
    os.close(fd)  # closing drops the flock


@contextlib.contextmanager
def try_lock(rid: str) -> Iterator[None]:
    """Hold the runtime's lock for the block, or raise :class:`LockBusy` at once."""
    fd = acquire_lock(rid)
    try:
        yield
    finally:
        release_lock(fd)


def cleanup(rid: str) -> list[str]:
    """Undo what an interrupted install left (call with the lock held): staging directories
    are removed; an ``.old-<install>-*`` directory is restored if its install is gone (the
    process died between the two renames of a replacement), else removed. Returns what it did."""
    base = runtime_dir(rid)
    done: list[str] = []
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except FileNotFoundError:
        return done
    for entry in entries:
        if entry.name.startswith(STAGING):
            shutil.rmtree(entry.path, ignore_errors=True)
            done.append(f"removed {entry.name}")
        elif entry.name.startswith(OLD):
            name = entry.name[len(OLD):].rsplit("-", 1)[0]
            target = base / name
            if valid_name(name) and not target.exists() and not entry.name.endswith("-removed"):
                os.rename(entry.path, target)
                done.append(f"restored {name}")
            else:
                shutil.rmtree(entry.path, ignore_errors=True)
                done.append(f"removed {entry.name}")
        elif entry.name.startswith((".current-", ".pinned-")):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    return done


def cleanup_all() -> None:
    """At the start of a runtime command or ``serve``: clean every runtime not being installed."""
    root = home() / "runtimes"
    try:
        names = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for rid in names:
        try:
            with try_lock(rid):
                cleanup(rid)
        except (LockBusy, OSError):
            continue
