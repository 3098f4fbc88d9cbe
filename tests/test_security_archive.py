"""Runtime archives may write only inside their install (issue 41, red-team F5 and row 52).

Ported from the red team's ``evil_tar.py`` (the CVE-2025-4517 shape: a chain of symbolic
links resolved past PATH_MAX, which Python 3.11.7's ``data`` filter let through) and
``archives.py`` (links, devices, ``..``, absolute names, zip tricks, 200,000 members).
Each archive is unpacked directly (fast) and the worst ones also through a whole install,
which must fail with one line and leave ``$SUPERFLUID_HOME`` as it was.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import threading
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import trio

from superfluid.runtime import _archive, _home
from superfluid.runtime import _install as inst
from superfluid.runtime._archive import Limits, UnsafeArchive, unpack

from . import test_runtime_install as installs
from .test_runtime_install import WORKER_SCRIPT, Server, _file, _install_v1, _leftovers, _plan, _tar, _v1_intact, cli

# the install tests' fixtures: a temporary SUPERFLUID_HOME (autouse) and an HTTP server
home = installs.home
served = installs.served

PWNED = "PWNED-by-archive.txt"


# -- building archives ------------------------------------------------------------------------


def _member(name: str, kind: str = "file", data: bytes = b"", link: str = "", mode: int = 0o644,
            pax: dict[str, str] | None = None) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    if pax:
        info.pax_headers = pax
    if kind == "file":
        info.size = len(data)
        return info, data
    info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
                 "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE}[kind]
    info.linkname = link
    if kind in ("chr", "blk"):
        info.devmajor, info.devminor = 1, 3
    return info, None


def _write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], mode: str = "w") -> Path:
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def evil_tar(out: Path, dest: str, m: int, fname: str = PWNED) -> Path:
    """red-team-scripts/evil_tar.py: passes a lexical member check and (before Python
    3.11.13 / 3.12.11 / 3.13.4) tarfile's data filter, then writes ``fname`` m + 1
    levels above the parent of ``dest`` (the directory it is unpacked in)."""
    steps = "abcdefghijklmnop"
    max_path = os.pathconf("/tmp", "PC_PATH_MAX")
    component = "d" * ((max_path - (len(dest) + 1)) // (len(steps) + 1))
    members = []
    path = ""
    for s in steps:
        members.append(_member(os.path.join(path, component), "dir", mode=0o755))
        members.append(_member(os.path.join(path, s), "sym", link=component))
        path = os.path.join(path, component)
    linkpath = os.path.join(*steps, "l" * 254)
    members.append(_member(linkpath, "sym", link=os.path.join(*[".."] * len(steps))))
    a = os.path.join(*[f"A{i}" for i in range(1, m + 1)])
    for i in range(1, m + 1):
        members.append(_member(os.path.join(*[f"A{j}" for j in range(1, i + 1)]), "dir", mode=0o755))
    members.append(_member(os.path.join(a, "escape"), "sym", link=os.path.join(*([".."] * m), linkpath, "..")))
    members.append(_member(os.path.join(a, "escape", *([".."] * (m + 1)), fname),
                           data=b"written outside the install by a runtime archive\n"))
    members.append(_member("bin/superfluid-worker-basert", data=WORKER_SCRIPT.encode(), mode=0o755))
    return _write_tar(out, members)


def _zip(path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    """``(name, data, st_mode)``: st_mode (type and permissions) goes in the external attributes."""
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name: that is the point
        for name, data, st_mode in members:
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = st_mode << 16
            zf.writestr(info, data)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _as_it_was(home: Path, before: dict[str, str]) -> bool:
    """``home`` holds what it held before, plus at most the failed install's own log: 0600,
    named in the error, the one thing a refused install leaves on purpose (it says why)."""
    after = _everything(home)
    logs = {k: v for k, v in after.items() if k.endswith(".failed.log") and k not in before}
    assert all(v.startswith("file 600 ") for v in logs.values()), logs
    return {k: v for k, v in after.items() if k not in logs} == before


def _everything(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) with its kind, mode and content: a
    before/after picture. The runtime's ``.lock`` holds the last locker's pid, so only its
    presence counts."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link " + os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = f"dir {st.st_mode & 0o7777:o}"
            elif name == ".lock":
                out[rel] = "lock"
            else:
                out[rel] = f"file {st.st_mode & 0o7777:o} {_sha(path)}"
    return out


def _outside(tmp_path: Path, into: Path) -> dict[str, str]:
    return {k: v for k, v in _everything(tmp_path).items()
            if not (tmp_path / k).is_relative_to(into) and not k.endswith((".tar", ".zip", ".gz"))}


# -- the CVE-2025-4517 shape ------------------------------------------------------------------


def test_cve_2025_4517_symlink_chain_writes_nothing_outside(tmp_path: Path) -> None:
    into = tmp_path / "x" / "y" / "into"
    into.mkdir(parents=True)
    archive = evil_tar(tmp_path / "evil.tar", str(into), m=1)  # aims at tmp_path/PWNED
    before = _outside(tmp_path, into)
    with pytest.raises(UnsafeArchive, match="'a' is a symbolic link"):
        unpack(archive, into)
    assert _outside(tmp_path, into) == before
    assert not (tmp_path / PWNED).exists()
    assert not any(PWNED in files for _d, _s, files in os.walk(tmp_path))


def test_cve_2025_4517_install_over_http_fails_in_one_line_and_leaves_home_as_it_was(
        served: tuple[Path, Server], home: Path) -> None:
    """The red team's repro: ``runtime install basert --from http://…/evil.tar --sha256 H``
    wrote ``$SUPERFLUID_HOME/PWNED-by-archive.txt``, then failed its check; the file stayed."""
    root, server = served
    _install_v1(home.parent)
    before = _everything(home)
    staging = home / "runtimes" / "basert" / f"{_home.STAGING}1.0-cpu-{'0' * 8}" / ".download" / "tree"
    archive = evil_tar(root / "evil.tar", str(staging), m=3)  # m + 1 = 4 levels above .download: $SUPERFLUID_HOME
    proc = cli("runtime", "install", "basert", "--from", f"{server.url}/evil.tar", "--sha256", _sha(archive),
               "--version", "1.0")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("superfluid: unsafe archive evil.tar: member 'a' is a symbolic link"), proc.stderr
    assert last.endswith("nothing was installed") and "Traceback" not in proc.stderr
    assert not (home / PWNED).exists() and not (home.parent / PWNED).exists()
    assert _as_it_was(home, before)
    _v1_intact()


# -- members refused --------------------------------------------------------------------------


def _absolute(tmp_path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [_member(str(tmp_path / "absolute.txt"), data=b"x")]


TAR_REFUSALS = {
    "symlink-out": ([_member("l", "sym", link="../../.."), _member("l/escape.txt", data=b"x")], "symbolic link"),
    "symlink-absolute": ([_member("bin", "sym", link="/tmp"), _member("bin/escape.txt", data=b"x")],
                         "symbolic link"),
    "symlink-inside-then-through": ([_member("sub", "dir"), _member("sub/in", "dir"), _member("a", "sym", link="sub/in"),
                                     _member("a/../../escape.txt", data=b"x")], "symbolic link"),
    "symlink-chain": ([_member("sub", "dir"), _member("sub/in", "dir"), _member("a", "sym", link="sub/in"),
                       _member("b", "sym", link="a/../.."), _member("b/escape.txt", data=b"x")], "symbolic link"),
    "hardlink-out": ([_member("h", "hard", link="/etc/passwd")], "hard link"),
    "hardlink-dotdot": ([_member("h", "hard", link="../escape.txt")], "hard link"),
    "hardlink-inside": ([_member("f", data=b"x"), _member("h", "hard", link="f")], "hard link"),
    "fifo": ([_member("f", "fifo")], "device or special file"),
    "char-device": ([_member("dev", "chr")], "device or special file"),
    "block-device": ([_member("dev", "blk")], "device or special file"),
    "dotdot": ([_member("../escape.txt", data=b"x")], "'..' component"),
    "nested-dotdot": ([_member("bin/../../escape.txt", data=b"x")], "'..' component"),
    "inner-dotdot": ([_member("a/../b.txt", data=b"x")], "'..' component"),
    "backslash": ([_member("..\\escape.txt", data=b"x")], "backslash"),
    "drive-letter": ([_member("C:escape.txt", data=b"x")], "absolute name"),
    "control-character": ([_member("lib/a\nb", data=b"x")], "control character"),
    "duplicate-file": ([_member("lib/x", data=b"1"), _member("lib/x", data=b"2")], "appears twice"),
    "duplicate-dir": ([_member("lib", "dir"), _member("lib/", "dir")], "appears twice"),
    "case-clash": ([_member("Lib/x", data=b"1"), _member("lib/y", data=b"2")], "differ only by case"),
    "normalization-clash": ([_member("caf\u00e9", data=b"1"), _member("cafe\u0301", data=b"2")],
                            "differ only by case or normalization"),
    "file-then-inside-it": ([_member("lib", data=b"1"), _member("lib/x", data=b"2")], "a file"),
    "dir-then-file": ([_member("lib/x", data=b"1"), _member("lib", data=b"2")], "a file and a directory"),
    "too-deep": ([_member("/".join(["d"] * 40) + "/x", data=b"x")], "deeper than"),
    "long-component": ([_member("x" * 300, data=b"x")], "longer than 255"),
    "empty-name": ([_member("./", data=b"x")], "empty name"),
}


@pytest.mark.parametrize("case", [*TAR_REFUSALS, "absolute"])
@pytest.mark.parametrize("compression", ["", "gz"])
def test_refused_tar_members_write_nothing_outside(tmp_path: Path, case: str, compression: str) -> None:
    members, why = TAR_REFUSALS[case] if case != "absolute" else (_absolute(tmp_path), "absolute name")
    archive = _write_tar(tmp_path / f"evil.tar{'.' + compression if compression else ''}", members,
                         f"w:{compression}" if compression else "w")
    _refused_writing_nothing_outside(tmp_path, archive, why)


def _refused_writing_nothing_outside(tmp_path: Path, archive: Path, why: str) -> None:
    """``archive`` unpacked into a fresh directory of ``tmp_path`` is refused for ``why`` and
    leaves everything outside that directory as it was."""
    into = tmp_path / "into"
    into.mkdir()
    before = _outside(tmp_path, into)
    with pytest.raises(UnsafeArchive, match=why):
        unpack(archive, into)
    assert _outside(tmp_path, into) == before
    assert not any("escape" in n or "absolute" in n for _d, _s, files in os.walk(tmp_path) for n in files)


ZIP_REFUSALS = {
    "dotdot": ([("../escape.txt", b"x", 0o100644)], "'..' component"),
    "backslash": ([("..\\escape.txt", b"x", 0o100644)], "backslash"),
    "inner-dotdot": ([("a/../b.txt", b"x", 0o100644)], "'..' component"),
    "symlink": ([("a", b"x", 0o100644), ("link", b"/etc", 0o120777)], "symbolic link"),
    "char-device": ([("dev", b"", 0o020644)], "device or special file"),
    "fifo": ([("f", b"", 0o010644)], "device or special file"),
    "duplicate": ([("x", b"1", 0o100644), ("x", b"2", 0o100644)], "appears twice"),
    "case-clash": ([("BIN/x", b"1", 0o100644), ("bin/y", b"2", 0o100644)], "differ only by case"),
}


@pytest.mark.parametrize("case", [*ZIP_REFUSALS, "absolute"])
def test_refused_zip_members_write_nothing_outside(tmp_path: Path, case: str) -> None:
    members, why = ZIP_REFUSALS[case] if case != "absolute" else \
        ([(str(tmp_path / "absolute.txt"), b"x", 0o100644)], "absolute name")
    archive = _zip(tmp_path / "evil.zip", members)
    _refused_writing_nothing_outside(tmp_path, archive, why)


# -- limits -----------------------------------------------------------------------------------


def _count(into: Path) -> int:
    return sum(len(dirs) + len(files) for _d, dirs, files in os.walk(into))


def test_too_many_members_is_refused_without_unpacking_them_all(tmp_path: Path) -> None:
    """archives.py's 200,000-member tar unpacked in 29 s with no limit; scaled down here:
    5,000 members against a limit of 100."""
    archive = tmp_path / "many.tar"
    with tarfile.open(archive, "w") as tar:
        for i in range(5000):
            info = tarfile.TarInfo(f"d{i // 1000}/f{i}")
            tar.addfile(info, io.BytesIO(b""))
    into = tmp_path / "into"
    into.mkdir()
    started = time.monotonic()
    with pytest.raises(UnsafeArchive, match="more than 100 members"):
        unpack(archive, into, Limits(members=100))
    assert time.monotonic() - started < 10  # generous: it stops at member 101
    assert _count(into) <= 101


def test_the_default_member_limit_is_bounded() -> None:
    assert 1_000 <= _archive.LIMITS.members <= 100_000
    assert _archive.LIMITS.member_bytes <= _archive.LIMITS.total_bytes <= 64 << 30
    assert _archive.LIMITS.header_bytes <= 256 << 20


def test_a_member_too_large_is_refused_before_it_is_written(tmp_path: Path) -> None:
    archive = _write_tar(tmp_path / "big.tar", [_member("lib/ok", data=b"x" * 1000),
                                                _member("lib/big", data=b"x" * 1001)])
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(UnsafeArchive, match="'lib/big' is 1001 bytes, more than the 1000 bytes"):
        unpack(archive, into, Limits(member_bytes=1000))
    assert (into / "lib" / "ok").exists() and not (into / "lib" / "big").exists()


def test_too_many_bytes_in_all_is_refused(tmp_path: Path) -> None:
    archive = _write_tar(tmp_path / "big.tar", [_member(f"lib/{i}", data=b"x" * 1000) for i in range(4)])
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(UnsafeArchive, match="unpacks to more than 3000 bytes"):
        unpack(archive, into, Limits(total_bytes=3000))
    assert sorted(os.listdir(into / "lib")) == ["0", "1", "2"]


def test_a_compressed_bomb_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    archive = _write_tar(tmp_path / "bomb.tar.gz", [_member("zeros", data=bytes(64 << 20))], "w:gz")
    assert archive.stat().st_size < 1 << 20
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(UnsafeArchive, match="is 67108864 bytes, more than the 1048576 bytes"):
        unpack(archive, into, Limits(member_bytes=1 << 20))
    assert os.listdir(into) == []


def test_a_huge_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """tarfile reads a pax header whole into memory, whatever size it declares."""
    archive = _write_tar(tmp_path / "pax.tar", [_member("x", data=b"x", pax={"comment": "c" * 200_000})])
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(UnsafeArchive, match="headers larger than 65536 bytes"):
        unpack(archive, into, Limits(header_bytes=64 << 10))


def test_zip_limits_are_read_from_its_end_record(tmp_path: Path) -> None:
    many = _zip(tmp_path / "many.zip", [(f"f{i}", b"", 0o100644) for i in range(5)])
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(UnsafeArchive, match="more than 4 members"):
        unpack(many, into, Limits(members=4))
    assert os.listdir(into) == []
    big = _zip(tmp_path / "big.zip", [("zeros", bytes(1 << 20), 0o100644)])
    with pytest.raises(UnsafeArchive, match="'zeros' is 1048576 bytes"):
        unpack(big, into, Limits(member_bytes=1000))
    assert os.listdir(into) == []


# -- what still unpacks -----------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["", "gz", "bz2", "xz"])
def test_a_good_tar_unpacks_with_safe_modes(tmp_path: Path, compression: str) -> None:
    archive = _write_tar(tmp_path / "good.tar", [
        _member("./", "dir", mode=0o755),
        _member("./pkg-1.0", "dir", mode=0o500),             # a read-only directory: made 0755 (removable)
        _member("./pkg-1.0/bin/superfluid-worker-basert", data=b"#!/bin/sh\n", mode=0o4777),  # set-uid, o+w
        _member("pkg-1.0/lib/engine.txt", data=b"data"),
        _member("pkg-1.0/lib/caf\u00e9.txt", data=b"accent"),
        _member("pkg-1.0/lib", "dir", mode=0o755),          # a directory after its files
    ], f"w:{compression}" if compression else "w")
    into = tmp_path / "into"
    into.mkdir()
    unpack(archive, into)
    root = into / "pkg-1.0"
    assert (root / "lib" / "engine.txt").read_bytes() == b"data"
    assert (root / "lib" / "caf\u00e9.txt").read_bytes() == b"accent"
    assert stat.S_IMODE((root / "bin" / "superfluid-worker-basert").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "lib" / "engine.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE(root.stat().st_mode) == 0o755


def test_a_good_zip_unpacks_with_its_executable_bits(tmp_path: Path) -> None:
    archive = _zip(tmp_path / "good.zip", [("bin/", b"", 0o040755), ("bin/superfluid-worker-basert", b"#!/bin/sh\n",
                                                                        0o106755), ("lib/engine.txt", b"data", 0o100664)])
    into = tmp_path / "into"
    into.mkdir()
    unpack(archive, into)
    assert stat.S_IMODE((into / "bin" / "superfluid-worker-basert").stat().st_mode) == 0o755
    assert stat.S_IMODE((into / "lib" / "engine.txt").stat().st_mode) == 0o644
    assert (into / "lib" / "engine.txt").read_bytes() == b"data"


# -- through an install -----------------------------------------------------------------------


INSTALL_REFUSALS = {
    "symlink": ([_member("lib/passwd", "sym", link="/etc/passwd")], "unsafe archive.*symbolic link"),
    "partly-written": ([_member("lib/a", data=b"1"), _member("lib/a", data=b"2")], "unsafe archive.*appears twice"),
    "the-log": ([_member("install.log", data=b"forged")], "unsafe archive.*'install.log' would replace"),
    "the-download": ([_member(".download/x", data=b"x")], "unsafe archive.*'.download' would replace"),
    "bin-a-file": ([_member("lib/x", data=b"x"), _member("bin", data=b"x")], "cannot unpack.*'bin'"),
}


@pytest.mark.parametrize("case", [*INSTALL_REFUSALS, "too-many"])
def test_a_refused_archive_leaves_home_as_it_was(tmp_path: Path, home: Path, case: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _install_v1(tmp_path)
    before = _everything(home)
    worker = [] if case == "bin-a-file" else [_file("bin/superfluid-worker-basert", WORKER_SCRIPT.encode(), 0o755)]
    if case == "too-many":
        monkeypatch.setattr(_archive, "LIMITS", Limits(members=10))
        members, why = [_member(f"lib/{i}", data=b"x") for i in range(20)], "unsafe archive.*more than 10 members"
    else:
        members, why = INSTALL_REFUSALS[case]
    archive = tmp_path / "evil.tar.gz"
    sha = _tar(archive, [*worker, *members])
    with pytest.raises(inst.InstallError, match=why):
        trio.run(inst.install, _plan(archive, sha, "2"))
    assert _as_it_was(home, before)
    _v1_intact()
    assert _leftovers() == []


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_a_good_archive_still_installs(tmp_path: Path, home: Path, kind: str) -> None:
    if kind == "zip":
        archive = _zip(tmp_path / "basert-2.zip", [("basert-2/bin/superfluid-worker-basert", WORKER_SCRIPT.encode(),
                                                    0o100755), ("basert-2/lib/engine.txt", b"data2", 0o100644)])
        sha = _sha(archive)
    else:
        archive = tmp_path / "basert-2.tar.gz"
        sha = _tar(archive, [_member("basert-2", "dir", mode=0o755),
                             _file("basert-2/bin/superfluid-worker-basert", WORKER_SCRIPT.encode(), 0o6755),
                             _file("basert-2/lib/engine.txt", b"data2")])
    record = trio.run(inst.install, _plan(archive, sha, "2"))
    assert _home.current("basert") == "2-cpu"
    assert record["files"]["lib/engine.txt"] == hashlib.sha256(b"data2").hexdigest()
    worker = _home.runtime_dir("basert") / "2-cpu" / "bin" / "superfluid-worker-basert"
    assert stat.S_IMODE(worker.stat().st_mode) == 0o755
    assert inst.verify("basert", "2-cpu") == []
    assert _leftovers() == []


def test_cancel_stops_an_unpack_between_members(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unpack runs in a thread that checks for cancellation at each member and chunk:
    Ctrl-C does not wait for a large archive to finish unpacking."""
    _install_v1(tmp_path)
    before = _everything(home)
    archive = tmp_path / "many.tar.gz"
    sha = _tar(archive, [_file("bin/superfluid-worker-basert", WORKER_SCRIPT.encode(), 0o755),
                         *[_member(f"lib/{i}", data=b"x") for i in range(2000)]])
    first, cancelled = threading.Event(), threading.Event()
    writes = []
    real_write = _archive._Tree.write

    def write(self: _archive._Tree, *args: object) -> None:
        real_write(self, *args)  # type: ignore[arg-type]
        writes.append(args[0])
        if len(writes) == 1:
            first.set()
            cancelled.wait(10)

    monkeypatch.setattr(_archive._Tree, "write", write)

    async def main() -> bool:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(inst.install, _plan(archive, sha, "2"))
                await trio.to_thread.run_sync(first.wait, 10)
                scope.cancel()
                cancelled.set()
        return scope.cancelled_caught

    assert trio.run(main)
    assert 1 <= len(writes) < 2000
    assert _as_it_was(home, before)
    _v1_intact()
