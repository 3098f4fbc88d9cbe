"""Issue #17, files and faults: private session files, where models may be loaded from and how
many, credentials kept from workers, and faults (no file descriptors, a full disk) that must not
take the daemon down. Mock runtime throughout."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import attrs
import httpx
import psutil
import pytest
import trio

from superfluid._config import ModelSource
from superfluid._private import make_private_dir
from superfluid.journal import JournalConfig, open_journal
from superfluid.proto._wal import body_created, body_finished

from .conftest import Daemon, mock_config, start_daemon, worker_pids

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "tell me a story"}], "temperature": 0}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask() -> object:
    """A umask that takes nothing away: modes must come from the code, not the umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


# ---- file modes -------------------------------------------------------------------------------


async def write_session(journal: object, sid: str) -> None:
    await journal.append(sid, body_created(params={}, klass="agent", model="m"))  # type: ignore[attr-defined]
    await journal.append(sid, body_finished(finish="stop"))  # type: ignore[attr-defined]


async def test_sessions_directory_and_every_journal_file_are_private(tmp_path: Path, open_umask: object) -> None:
    directory = tmp_path / "home" / "sessions"
    async with open_journal(directory, config=JournalConfig(keep_finished=0)) as journal:
        await write_session(journal, "a")
        await journal.compact()  # wal.log.compact renamed over wal.log
    async with open_journal(directory, fresh=True):  # the old log kept as wal.log.prev
        pass
    assert mode(directory) == 0o700 and mode(directory.parent) == 0o700
    names = sorted(os.listdir(directory))
    assert names == ["serve.lock", "wal.log", "wal.log.prev"]
    assert {name: mode(directory / name) for name in names} == dict.fromkeys(names, 0o600)


async def test_looser_modes_are_fixed_at_start_with_one_warning(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    async with open_journal(tmp_path / "s") as journal:
        await write_session(journal, "a")
    directory = tmp_path / "s"
    os.chmod(directory, 0o755)
    os.chmod(directory / "wal.log", 0o644)
    os.chmod(directory / "serve.lock", 0o640)
    (directory / "wal.log.corrupt-1").write_bytes(b"x")
    os.chmod(directory / "wal.log.corrupt-1", 0o666)
    with caplog.at_level(logging.WARNING, logger="superfluid.journal"):
        async with open_journal(directory) as journal:
            assert "a" in journal.sessions
    assert mode(directory) == 0o700
    assert {n: mode(directory / n) for n in os.listdir(directory)} == dict.fromkeys(os.listdir(directory), 0o600)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    for fragment in (f"{directory} (0755 -> 0700)", "wal.log (0644 -> 0600)", "serve.lock (0640 -> 0600)",
                     "wal.log.corrupt-1 (0666 -> 0600)"):
        assert fragment in warnings[0]
    # a second start finds nothing to fix and says nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="superfluid.journal"):
        async with open_journal(directory):
            pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_models_cache_directory_is_made_private(tmp_path: Path, open_umask: object) -> None:
    target = tmp_path / ".superfluid" / "models"
    make_private_dir(target)
    assert mode(target) == 0o700 and mode(target.parent) == 0o700
    os.chmod(target, 0o755)  # an existing directory is the operator's: left as it is
    make_private_dir(target)
    assert mode(target) == 0o755
