"""Unpacking an install archive without letting it write outside the install.

The standard library's extractors are not used: a lexical check of member names followed
by ``tarfile``'s ``data`` filter let a chain of symbolic links resolved past ``PATH_MAX``
write outside the install (CVE-2025-4517, Python before 3.11.13 / 3.12.11 / 3.13.4), and
nothing bounded how many members or bytes an archive unpacks to. So each member is read,
checked and written here, one at a time, with nothing but regular files and directories
ever created:

* a name is a plain relative POSIX path of at most :attr:`Limits.depth` components and
  :attr:`Limits.name_bytes` bytes: no absolute name, no drive letter, no ``..`` component,
  no backslash, no control character;
* symbolic links, hard links, devices, FIFOs, sparse files and any other kind of member
  are refused, whatever they point at (a link inside the install can be the first step of
  a way out, so none is made);
* every name appears once, a file is never also a directory, and no two names differ only
  by case or Unicode normalization (on a case-insensitive file system, such as macOS's,
  they would be one file);
* at most :attr:`Limits.members` members, each at most :attr:`Limits.member_bytes`, all
  together at most :attr:`Limits.total_bytes`, as declared and as written; a tar's
  headers (the bytes it reads that are not member data) at most
  :attr:`Limits.header_bytes`, a zip's central directory likewise;
* every directory is made here (0755) and walked into by a descriptor opened with
  ``O_NOFOLLOW``, every file is created with ``O_EXCL | O_NOFOLLOW`` inside one, its
  mode the archive's without set-id, sticky or group/other write bits.

A refused archive raises :class:`UnsafeArchive` (one line). Members written before the
refusal are inside ``into``, never elsewhere: the caller removes it (an install removes
its whole staging directory).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import stat
import tarfile
import unicodedata
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["LIMITS", "Limits", "UnsafeArchive", "unpack"]

CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeArchive(Exception):
    """An archive member is refused: it would land outside the install, is not a regular
    file or directory, collides with another, or the archive is larger than its limits."""


@dataclass(frozen=True)
class Limits:
    """What one archive may unpack to. The defaults fit a runtime with a bundled Python
    environment and CUDA libraries (tens of thousands of files, tens of GiB)."""

    members: int = 100_000
    member_bytes: int = 8 << 30
    total_bytes: int = 32 << 30
    header_bytes: int = 128 << 20
    name_bytes: int = 1024
    depth: int = 32


LIMITS = Limits()


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n} bytes"


# -- names ------------------------------------------------------------------------------------


def _parts(name: str, limits: Limits) -> tuple[str, ...]:
    """``name``'s path components (``.`` and empty ones dropped), or refused."""
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(f"member {name!r} is an absolute name")
    if "\\" in name:
        raise UnsafeArchive(f"member {name!r} has a backslash in its name")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise UnsafeArchive(f"member {name!r} has a control character in its name")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UnsafeArchive(f"member {name!r} has a '..' component")
    if len(parts) > limits.depth or len(name.encode("utf-8", "surrogateescape")) > limits.name_bytes:
        raise UnsafeArchive(f"member {name[:80]!r}…: a name longer than {limits.name_bytes} bytes or deeper "
                            f"than {limits.depth} directories")
    if any(len(p.encode("utf-8", "surrogateescape")) > 255 for p in parts):
        raise UnsafeArchive(f"member {name[:80]!r}…: a path component longer than 255 bytes")
    return parts


def _fold(part: str) -> str:
    """The key under which a case-insensitive, normalization-insensitive file system
    (APFS, HFS+, NTFS) stores ``part``."""
    return unicodedata.normalize("NFC", part).casefold()


@dataclass
class _Node:
    name: str
    is_dir: bool
    explicit: bool
    children: dict[str, _Node] = field(default_factory=dict)


class _Names:
    """Every path an archive has named so far (and each directory above one), by folded
    component: what makes a duplicate, a file that is also a directory, or a case clash."""

    def __init__(self) -> None:
        self.root = _Node("", True, True)

    def admit(self, name: str, parts: tuple[str, ...], is_dir: bool) -> None:
        node = self.root
        for i, part in enumerate(parts):
            last, key = i == len(parts) - 1, _fold(part)
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(part, is_dir or not last, last)
            elif child.name != part:
                other = "/".join((*parts[:i], child.name))
                raise UnsafeArchive(f"member {name!r} and {other!r} differ only by case or normalization")
            elif not last and not child.is_dir:
                raise UnsafeArchive(f"member {name!r} is inside {'/'.join(parts[: i + 1])!r}, a file")
            elif last and child.explicit:
                raise UnsafeArchive(f"member {name!r} appears twice")
            elif last and not is_dir:
                raise UnsafeArchive(f"member {name!r} is a file and a directory")
            elif last:
                child.explicit = True
            node = child


# -- writing ----------------------------------------------------------------------------------


class _Tree:
    """The directory an archive unpacks into, written through descriptors only: each
    directory is made here and opened with ``O_NOFOLLOW``, each file created with
    ``O_EXCL``, so no path is ever resolved through something the archive made."""

    def __init__(self, into: Path, limits: Limits, check: Callable[[], None]) -> None:
        self.limits = limits
        self.check = check
        self.names = _Names()
        self.members = 0
        self.total = 0
        self.root = os.open(into, _DIR_FLAGS)
        self._cached: tuple[tuple[str, ...], int] | None = None  # the last parent (archives are grouped by dir)

    def close(self) -> None:
        if self._cached is not None:
            os.close(self._cached[1])
            self._cached = None
        os.close(self.root)

    def admit(self, name: str, *, is_dir: bool, size: int) -> tuple[str, ...]:
        """Check one member against every rule and limit before any byte of it is written."""
        self.check()
        self.members += 1
        if self.members > self.limits.members:
            raise UnsafeArchive(f"more than {self.limits.members} members")
        parts = _parts(name, self.limits)
        if not parts and not is_dir:
            raise UnsafeArchive(f"member {name!r} has an empty name")
        if size < 0:
            raise UnsafeArchive(f"member {name!r} declares a negative size")
        if size > self.limits.member_bytes:
            raise UnsafeArchive(f"member {name!r} is {_gib(size)}, more than the {_gib(self.limits.member_bytes)} "
                                "a member may be")
        self.total += size
        if self.total > self.limits.total_bytes:
            raise UnsafeArchive(f"unpacks to more than {_gib(self.limits.total_bytes)}")
        if parts:
            self.names.admit(name, parts, is_dir)
        return parts

    def _dir(self, parts: tuple[str, ...]) -> int:
        """A descriptor of directory ``parts`` (made where missing); the tree keeps it."""
        if self._cached is not None and self._cached[0] == parts:
            return self._cached[1]
        fd = os.dup(self.root)
        try:
            for part in parts:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        if self._cached is not None:
            os.close(self._cached[1])
        self._cached = (parts, fd)
        return fd

    def mkdir(self, parts: tuple[str, ...]) -> None:
        if parts:
            self._dir(parts)

    def write(self, name: str, parts: tuple[str, ...], chunks: Iterator[bytes], size: int, mode: int) -> None:
        """Create file ``parts`` (it must not exist) from ``chunks``: exactly ``size`` bytes."""
        parent = self._dir(parts[:-1])
        fd = os.open(parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent)
        with os.fdopen(fd, "wb") as out:
            written = 0
            for chunk in chunks:
                self.check()
                written += len(chunk)
                if written > size:
                    raise UnsafeArchive(f"member {name!r} holds more than the {size} bytes it declares")
                out.write(chunk)
            if written != size:
                raise tarfile.ReadError(f"member {name!r}: unexpected end of data")
            os.fchmod(out.fileno(), (mode & 0o755) | 0o600)


# -- tar --------------------------------------------------------------------------------------


class _Metered:
    """A tar's (decompressed) byte stream for :mod:`tarfile`, which reads whole headers
    into memory (a pax or GNU long-name header of any declared size): every byte it reads
    or skips that is not member data counts against ``Limits.header_bytes``, checked
    before it is read."""

    def __init__(self, raw: IO[bytes], budget: int) -> None:
        self.raw = raw
        self.budget = budget
        self.used = 0

    def _charge(self, n: int) -> None:
        self.used += max(n, 0)
        if self.used > self.budget:
            raise UnsafeArchive(f"headers larger than {_gib(self.budget)}")

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            raise UnsafeArchive("an unbounded header read")
        self._charge(n)
        return self.raw.read(n)

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            self._charge(pos - self.raw.tell())
        return self.raw.seek(pos, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def data(self, offset: int, size: int) -> Iterator[bytes]:
        """``size`` bytes of member data at ``offset`` (already counted by the limits)."""
        self.raw.seek(offset)
        left = size
        while left:
            chunk = self.raw.read(min(left, CHUNK))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


def _decompressed(raw: IO[bytes]) -> IO[bytes]:
    head = raw.read(6)
    raw.seek(0)
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(raw)
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw)
    return raw


def _kind(m: tarfile.TarInfo) -> str | None:
    """Why member ``m`` is refused for its type, or None (a regular file or directory)."""
    if m.issym():
        return "a symbolic link (links are refused)"
    if m.islnk():
        return "a hard link (links are refused)"
    if m.ischr() or m.isblk() or m.isfifo():
        return "a device or special file"
    if m.issparse():
        return "a sparse file"
    if not (m.isfile() or m.isdir()):
        return "of an unsupported type"
    return None


def _unpack_tar(archive: Path, tree: _Tree) -> None:
    with open(archive, "rb") as raw, _decompressed(raw) as stream:
        metered = _Metered(stream, tree.limits.header_bytes)
        with tarfile.open(fileobj=metered, mode="r:") as tar:  # type: ignore[call-overload]
            while (m := tar.next()) is not None:
                del tar.members[:]  # tarfile keeps every header it read; nothing here needs them
                why = _kind(m)
                if why is not None:
                    raise UnsafeArchive(f"member {m.name!r} is {why}")
                parts = tree.admit(m.name, is_dir=m.isdir(), size=0 if m.isdir() else m.size)
                if m.isdir():
                    tree.mkdir(parts)
                else:
                    tree.write(m.name, parts, metered.data(m.offset_data, m.size), m.size, m.mode)


# -- zip --------------------------------------------------------------------------------------


def _zip_index(archive: Path, limits: Limits) -> None:
    """Refuse a zip by its end record, before :mod:`zipfile` reads its whole central
    directory into memory."""
    with open(archive, "rb") as f:
        end: Any = zipfile._EndRecData(f)  # type: ignore[attr-defined] # noqa: SLF001 - no public way to read it
    if end is None:
        raise zipfile.BadZipFile("no end of central directory")
    if end[zipfile._ECD_ENTRIES_TOTAL] > limits.members:  # type: ignore[attr-defined] # noqa: SLF001
        raise UnsafeArchive(f"more than {limits.members} members")
    if end[zipfile._ECD_SIZE] > limits.header_bytes:  # type: ignore[attr-defined] # noqa: SLF001
        raise UnsafeArchive(f"a central directory larger than {_gib(limits.header_bytes)}")


def _zip_chunks(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Iterator[bytes]:
    with zf.open(info) as src:
        while chunk := src.read(CHUNK):
            yield chunk


def _unpack_zip(archive: Path, tree: _Tree) -> None:
    _zip_index(archive, tree.limits)
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            mode = info.external_attr >> 16
            kind = stat.S_IFMT(mode)
            if kind == stat.S_IFLNK:
                raise UnsafeArchive(f"member {info.filename!r} is a symbolic link (refused in zip archives)")
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise UnsafeArchive(f"member {info.filename!r} is a device or special file")
            is_dir = info.is_dir()
            parts = tree.admit(info.filename, is_dir=is_dir, size=0 if is_dir else info.file_size)
            if is_dir:
                tree.mkdir(parts)
            else:
                tree.write(info.filename, parts, _zip_chunks(zf, info), info.file_size,
                           mode if info.create_system == 3 and mode else 0o644)


def _go_on() -> None:
    pass


def unpack(archive: Path, into: Path, limits: Limits | None = None, *, check: Callable[[], None] = _go_on) -> None:
    """Extract ``archive`` (a tar, plain or gzip/bzip2/xz-compressed, or a zip) into the
    empty directory ``into``, under :data:`LIMITS` unless ``limits`` is given. ``check`` is
    called before each member and each chunk written, so that a caller in a thread can
    stop it there (``trio.from_thread.check_cancelled``): an archive of many GiB is not a
    reason for Ctrl-C to wait.

    Raises:
        UnsafeArchive: a member is refused (what was written is inside ``into``).
        tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, lzma.LZMAError: not a
            readable archive.
        Whatever ``check`` raises.
    """
    tree = _Tree(into, limits or LIMITS, check)
    try:
        if zipfile.is_zipfile(archive):
            _unpack_zip(archive, tree)
        else:
            _unpack_tar(archive, tree)
    finally:
        tree.close()
