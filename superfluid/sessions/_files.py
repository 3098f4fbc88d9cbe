"""Uploaded files (OpenAI's Files API): what batches read their requests from and write their
results to (SPEC.md §7, "Files"). No HTTP here: the routes are ``api/_files.py``.

Files live under ``<sessions>/files/`` (0700): each as its data, ``<id>`` (0600), and its
metadata, ``<id>.json`` (0600). Both are written under a temporary name (``.tmp-…``), fsynced
and renamed, data first: the metadata's rename is the commit point, so a crash never leaves a
half file visible. A delete removes the metadata first for the same reason. Opening the store
(:meth:`FileStore.open`) removes stray temporary files and drops data without metadata and
metadata without data (what a crash between the two renames of a create or a delete leaves).

An upload streams to disk as it arrives (never the whole file in memory), counted against its
tenant's quota byte by byte: bytes of uploads under way count too, so two concurrent uploads
cannot together pass the quota. Files are the tenant's: another tenant's id answers as an
unknown one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import trio

from .._private import DIR_MODE, FILE_MODE, fsync_dir, make_private_dir

__all__ = ["BATCH_OUTPUT", "UPLOAD_PURPOSES", "FileStore", "FilesQuotaExceeded", "StoredFile", "Upload"]

log = logging.getLogger("superfluid.files")

# what clients send (only ``batch`` files are read by batches; the others are kept as sent)
UPLOAD_PURPOSES = frozenset({"batch", "fine-tune", "assistants", "user_data", "evals", "vision"})
BATCH_OUTPUT = "batch_output"   # a batch's output and error files (made by the server, never uploaded)

_ID = re.compile(r"file-[0-9a-f]{24}")
_META = ".json"
_TMP = ".tmp-"                  # every name a create writes before its rename starts so
_FLUSH = 1 << 20                # bytes of an upload gathered before one write (in a thread)


@attrs.frozen
class StoredFile:
    """One stored file's metadata (its bytes are at :meth:`FileStore.path`)."""

    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int             # unix seconds
    created_ns: int = attrs.field(default=0, repr=False)  # orders files made within one second (listing)

    def public(self) -> dict[str, Any]:
        """The OpenAI File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}

    def _record(self) -> dict[str, Any]:
        return {"id": self.id, "tenant": self.tenant, "filename": self.filename, "purpose": self.purpose,
                "bytes": self.bytes, "created_at": self.created_at, "created_ns": self.created_ns}

    @classmethod
    def _of_record(cls, record: Any, fid: str) -> StoredFile:
        """Raises ValueError for a record that is not one this module wrote for ``fid``."""
        if not isinstance(record, dict) or record.get("id") != fid:
            raise ValueError("not a file record")
        strings = [record.get(k) for k in ("tenant", "filename", "purpose")]
        numbers = [record.get(k) for k in ("bytes", "created_at", "created_ns")]
        if (not all(isinstance(s, str) for s in strings)
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers)):
            raise ValueError("a field of the wrong type")
        return cls(fid, *strings, *numbers)


class FilesQuotaExceeded(Exception):
    """An upload would take its tenant's files past the quota: ``used`` bytes are
    stored (or being uploaded by the tenant's other uploads) already, ``quota`` are
    allowed, and this upload had reached ``upload`` bytes."""

    def __init__(self, used: int, quota: int, upload: int = 0) -> None:
        super().__init__(f"the tenant's files would exceed their quota of {quota} bytes ({used} bytes in use, "
                         f"this upload {upload} bytes so far)")
        self.used = used
        self.quota = quota
        self.upload = upload


@attrs.define(eq=False)
class Upload:
    """An upload whose bytes are on disk under a temporary name, not yet a file:
    :meth:`FileStore.commit` makes it one, :meth:`FileStore.discard` drops it. Its
    bytes count against its tenant's quota until then."""

    id: str
    tenant: str
    temp: Path
    bytes: int = 0
    done: bool = False          # committed or discarded


class FileStore:
    """The files of every tenant in one directory; :meth:`open` builds one from disk."""

    def __init__(self, directory: Path, *, quota_bytes: int) -> None:
        self.directory = directory
        self.quota_bytes = quota_bytes      # per tenant; 0: no limit
        self._files: dict[str, StoredFile] = {}
        self._used: dict[str, int] = {}     # committed bytes per tenant
        self._pending: dict[str, int] = {}  # bytes of uploads under way per tenant

    @classmethod
    def open(cls, directory: Path, *, quota_bytes: int) -> FileStore:
        """The store of ``directory`` (made 0700 if missing): stray temporary files are
        removed, halves of a file (data or metadata alone) dropped, with a warning."""
        store = cls(directory, quota_bytes=quota_bytes)
        make_private_dir(directory)
        if stat.S_IMODE(directory.stat().st_mode) != DIR_MODE:
            log.warning("files directory %s was %04o; made %04o", directory, stat.S_IMODE(directory.stat().st_mode),
                        DIR_MODE)
            os.chmod(directory, DIR_MODE)
        names = set(os.listdir(directory))
        for name in sorted(names):
            if name.startswith(_TMP):
                _unlink(directory / name)
                log.info("files: removed %s, an upload a stop cut short", name)
        data = {n for n in names if _ID.fullmatch(n)}
        meta = {n[:-len(_META)] for n in names if n.endswith(_META) and _ID.fullmatch(n[:-len(_META)])}
        for fid in sorted(data ^ meta):
            _unlink(directory / (fid if fid in data else fid + _META))
            log.warning("files: dropped %s, its %s having no %s (a create or delete cut short)", fid,
                        "data" if fid in data else "metadata", "metadata" if fid in data else "data")
        for fid in sorted(data & meta):
            try:
                f = StoredFile._of_record(json.loads((directory / (fid + _META)).read_bytes()), fid)
                size = (directory / fid).stat().st_size
                if size != f.bytes:
                    raise ValueError(f"{size} bytes on disk, {f.bytes} in its metadata")
            except (OSError, ValueError) as exc:  # (json's errors are ValueErrors)
                log.warning("files: dropped %s: unreadable metadata (%s)", fid, exc)
                _unlink(directory / (fid + _META))
                _unlink(directory / fid)
                continue
            store._add(f)
        return store

    # ---- reading ----

    def get(self, tenant: str, file_id: str) -> StoredFile | None:
        """The tenant's file ``file_id``; None for an unknown id and for another tenant's alike."""
        f = self._files.get(file_id)
        return f if f is not None and f.tenant == tenant else None

    def path(self, f: StoredFile) -> Path:
        """Where ``f``'s bytes are (open it before a delete could remove it: an open file stays readable)."""
        return self.directory / f.id

    def list(self, tenant: str, *, purpose: str | None = None, after: str | None = None, limit: int = 10000,
             order: str = "desc") -> list[StoredFile]:
        """The tenant's files (of ``purpose``, if given) by creation time, newest first
        (``order="desc"``) or oldest first (``"asc"``); those following ``after`` in that
        order if it names one of them (an id that names none lists nothing); at most ``limit``."""
        files = sorted((f for f in self._files.values() if f.tenant == tenant
                        and (purpose is None or f.purpose == purpose)),
                       key=lambda f: (f.created_ns, f.id), reverse=order != "asc")
        if after is not None:
            at = next((i for i, f in enumerate(files) if f.id == after), None)
            files = [] if at is None else files[at + 1:]
        return files[:max(0, limit)]

    def used_bytes(self, tenant: str) -> int:
        """Bytes of the tenant's stored files (uploads under way not counted)."""
        return self._used.get(tenant, 0)

    # ---- writing ----

    async def create(self, tenant: str, filename: str, purpose: str, chunks: AsyncIterator[bytes], *,
                     quota: bool = True) -> StoredFile:
        """A new file of ``chunks``' bytes (:meth:`receive`, then :meth:`commit`).

        Raises:
            FilesQuotaExceeded: (``quota`` True) the tenant's quota would be passed; nothing is kept.
            OSError: the disk refused; nothing is kept.
        """
        upload = await self.receive(tenant, chunks, quota=quota)
        return await self.commit(upload, filename=filename, purpose=purpose)

    async def receive(self, tenant: str, chunks: AsyncIterator[bytes], *, quota: bool = True) -> Upload:
        """``chunks`` written to a temporary file as they come (gathered up to 1 MiB, written
        and finally fsynced in a thread), each counted against the tenant's quota as it arrives.
        ``quota=False`` (a batch's output) counts the bytes but never refuses them.

        Raises:
            FilesQuotaExceeded: the tenant's quota would be passed; the temporary file is removed.
            OSError: the disk refused; the temporary file is removed.
            whatever ``chunks`` raised (a malformed body, a client gone); the temporary file is removed.
        """
        fid = f"file-{secrets.token_hex(12)}"
        upload = Upload(id=fid, tenant=tenant, temp=self.directory / f"{_TMP}{fid}")
        fd = await trio.to_thread.run_sync(_create_private, upload.temp)
        buffer = bytearray()
        try:
            async for chunk in chunks:
                if not chunk:
                    continue
                self._reserve(upload, len(chunk), enforce=quota)
                buffer += chunk
                if len(buffer) >= _FLUSH:
                    await trio.to_thread.run_sync(_write_all, fd, buffer)
                    buffer.clear()
            await trio.to_thread.run_sync(_write_all, fd, buffer)
            await trio.to_thread.run_sync(os.fsync, fd)
        except BaseException:
            os.close(fd)
            self.discard(upload)
            raise
        os.close(fd)
        return upload

    async def commit(self, upload: Upload, *, filename: str, purpose: str) -> StoredFile:
        """Make ``upload`` a file: its data renamed to ``<id>``, then its metadata written,
        fsynced and renamed to ``<id>.json`` (the commit), then the directory fsynced.

        Raises:
            OSError: the disk refused; the upload is discarded.
        """
        now = time.time_ns()
        f = StoredFile(upload.id, upload.tenant, filename, purpose, upload.bytes, now // 1_000_000_000, now)
        try:
            await trio.to_thread.run_sync(_commit, self.directory, upload.temp, f)
        except BaseException:
            self.discard(upload)
            _unlink(self.directory / (f.id + _META))  # (half done: neither half stays)
            _unlink(self.directory / f.id)
            raise
        upload.done = True
        self._release(upload)
        self._add(f)
        return f

    def discard(self, upload: Upload) -> None:
        """Drop an upload (its temporary file, its share of the quota); a no-op once done."""
        if upload.done:
            return
        upload.done = True
        self._release(upload)
        _unlink(upload.temp)  # one unlink, on the event loop: also where a cancelled upload is cleaned up

    async def delete(self, tenant: str, file_id: str) -> bool:
        """Delete the tenant's file ``file_id``: its metadata first (the commit), then its data.
        False if the tenant has no such file (another tenant's included).

        Raises:
            OSError: the metadata could not be removed; the file stays.
        """
        f = self.get(tenant, file_id)
        if f is None:
            await trio.lowlevel.checkpoint()
            return False
        self._remove(f)  # at once: no new reader finds it while it goes
        try:
            await trio.to_thread.run_sync(_delete, self.directory, f.id)
        except BaseException:
            if not (self.directory / (f.id + _META)).exists():
                raise  # (gone after all: the data is dropped at the next open)
            self._add(f)
            raise
        return True

    # ---- the index ----

    def _add(self, f: StoredFile) -> None:
        self._files[f.id] = f
        self._used[f.tenant] = self._used.get(f.tenant, 0) + f.bytes

    def _remove(self, f: StoredFile) -> None:
        del self._files[f.id]
        self._used[f.tenant] -= f.bytes
        if not self._used[f.tenant]:
            del self._used[f.tenant]

    def _reserve(self, upload: Upload, n: int, *, enforce: bool) -> None:
        used = self._used.get(upload.tenant, 0) + self._pending.get(upload.tenant, 0)
        if enforce and self.quota_bytes and used + n > self.quota_bytes:
            raise FilesQuotaExceeded(used - upload.bytes, self.quota_bytes, upload.bytes + n)
        self._pending[upload.tenant] = self._pending.get(upload.tenant, 0) + n
        upload.bytes += n

    def _release(self, upload: Upload) -> None:
        left = self._pending.get(upload.tenant, 0) - upload.bytes
        if left > 0:
            self._pending[upload.tenant] = left
        else:
            self._pending.pop(upload.tenant, None)


# ---- blocking file work (in threads, but for the unlinks) ----

def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _create_private(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _commit(directory: Path, temp: Path, f: StoredFile) -> None:
    os.rename(temp, directory / f.id)
    meta_temp = directory / f"{_TMP}{f.id}{_META}"
    fd = _create_private(meta_temp)
    try:
        _write_all(fd, json.dumps(f._record(), ensure_ascii=False).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(meta_temp)
        raise
    os.close(fd)
    try:
        os.rename(meta_temp, directory / (f.id + _META))
    except BaseException:
        _unlink(meta_temp)
        raise
    fsync_dir(directory)


def _delete(directory: Path, fid: str) -> None:
    os.unlink(directory / (fid + _META))
    _unlink(directory / fid)
    fsync_dir(directory)
