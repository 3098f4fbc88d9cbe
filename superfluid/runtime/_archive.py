"""Unpacking an install archive without letting it write outside the install.

Every member is checked before anything is written: an absolute name, a ``..`` that
climbs out, a symbolic or hard link whose target lands outside, a device file, a FIFO:
the whole archive is refused (:class:`UnsafeArchive`), nothing is extracted. Then the
standard library's ``data`` filter extracts it (a second guard with the same rules).
"""

from __future__ import annotations

import posixpath
import tarfile
import zipfile
from pathlib import Path

__all__ = ["UnsafeArchive", "unpack"]


class UnsafeArchive(Exception):
    """An archive member would land outside the install, or is a device or special file."""


def _inside(name: str) -> bool:
    """``name`` (relative, POSIX) stays inside the directory it is unpacked in."""
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return False
    norm = posixpath.normpath(name)
    return norm != ".." and not norm.startswith("../")


def _check_tar(tar: tarfile.TarFile) -> None:
    for m in tar.getmembers():
        if not _inside(m.name):
            raise UnsafeArchive(f"member {m.name!r} would land outside the install")
        if m.issym():
            target = posixpath.join(posixpath.dirname(m.name), m.linkname)
            if m.linkname.startswith("/") or not _inside(target):
                raise UnsafeArchive(f"link {m.name!r} -> {m.linkname!r} points outside the install")
        elif m.islnk():
            if not _inside(m.linkname):
                raise UnsafeArchive(f"hard link {m.name!r} -> {m.linkname!r} points outside the install")
        elif m.ischr() or m.isblk() or m.isfifo() or m.isdev():
            raise UnsafeArchive(f"member {m.name!r} is a device or special file")
        elif not (m.isfile() or m.isdir()):
            raise UnsafeArchive(f"member {m.name!r} is of an unsupported type")


def unpack(archive: Path, into: Path) -> None:
    """Extract ``archive`` (a tar, compressed or not, or a zip) into the directory ``into``.

    Raises:
        UnsafeArchive: a member is refused (nothing was extracted).
        tarfile.TarError, zipfile.BadZipFile, OSError: not a readable archive.
    """
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if not _inside(info.filename):
                    raise UnsafeArchive(f"member {info.filename!r} would land outside the install")
                if (info.external_attr >> 16) & 0o170000 == 0o120000:
                    raise UnsafeArchive(f"member {info.filename!r} is a symbolic link (refused in zip archives)")
            zf.extractall(into)
            for info in zf.infolist():  # zip keeps no modes by default: restore the executable bits
                mode = (info.external_attr >> 16) & 0o777
                if mode and not info.is_dir():
                    (into / info.filename).chmod(mode)
        return
    with tarfile.open(archive) as tar:
        _check_tar(tar)
        tar.extractall(into, filter="data")
