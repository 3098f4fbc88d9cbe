"""Batches on disk: each one a directory with its own write-ahead log.

``<sessions>/batches/<batch id>/`` (0700) holds ``log`` (0600, the records of
``proto/_batch.py``) and ``input.jsonl``, a hard link to the input file taken
at creation (a copy where links are not possible): deleting the input file
through ``/v1/files`` cannot pull it from under a running batch, and a restart
reads the very bytes the batch was created from.

One writer per batch (:meth:`Batch.append`, under the batch's lock): a record is
written and fsynced before the call returns, so whatever a client was told
(the batch exists, a line is done, a cancel was taken) survives a SIGKILL. A
batch directory whose log never got its ``created`` record durable was never
acknowledged and is removed at open.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import trio

from .._private import fsync_dir
from ..proto._batch import BatchState, LineRecord, decode, encode, line_output, replay

__all__ = ["Batch", "BatchStore", "input_lines"]

log = logging.getLogger("superfluid.batches")

_READ_CHUNK = 1 << 20


class Batch:
    """One batch: its directory, its state as its log tells it, its one writer."""

    def __init__(self, directory: Path, state: BatchState, size: int) -> None:
        self.directory = directory
        self.state = state
        self._size = size               # the log's committed length
        self._lock = trio.Lock()        # the one writer
        self.changed = trio.Event()     # set (and replaced) after every record

    @property
    def id(self) -> str:
        return str(self.state.created["id"])

    @property
    def tenant(self) -> str:
        return str(self.state.created.get("tenant", ""))

    @property
    def input_path(self) -> Path:
        return self.directory / "input.jsonl"

    @property
    def log_path(self) -> Path:
        return self.directory / "log"

    async def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` and fsync it; then fold it into :attr:`state`."""
        data = encode(record)
        async with self._lock:
            offset = self._size
            await trio.to_thread.run_sync(self._write, data, offset)
            self._size = offset + len(data)
            self.state.apply(offset, len(data), record)
        self.changed.set()
        self.changed = trio.Event()

    def _write(self, data: bytes, offset: int) -> None:
        fd = os.open(self.log_path, os.O_WRONLY)
        try:
            os.ftruncate(fd, offset)  # a torn tail from before a crash, or a failed write, goes
            os.lseek(fd, offset, os.SEEK_SET)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    async def outputs(self, *, ok: bool) -> AsyncIterator[bytes]:
        """The output (``ok``) or error lines, in input order, each ending in a newline."""
        wanted = sorted((r for r in self.state.lines.values() if r.ok == ok), key=lambda r: r.index)
        for start in range(0, len(wanted), 256):
            chunk = await trio.to_thread.run_sync(self._read_lines, wanted[start:start + 256])
            yield chunk
        await trio.lowlevel.checkpoint()  # none to read: still a checkpoint (ASYNC911)

    def _read_lines(self, records: list[LineRecord]) -> bytes:
        out = bytearray()
        with open(self.log_path, "rb") as f:
            for r in records:
                f.seek(r.offset)
                one = decode(f.read(r.length))
                out += line_output(one.records[0][2]).rstrip(b"\n") + b"\n"
        return bytes(out)


class BatchStore:
    """Every batch under ``<sessions>/batches``, read back at open."""

    def __init__(self, directory: Path, batches: dict[str, Batch]) -> None:
        self.directory = directory
        self.batches = batches

    @classmethod
    def open(cls, directory: Path) -> BatchStore:
        """Scan ``directory`` (made 0700 if missing): every acknowledged batch, torn tails
        cut off when next written."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        batches: dict[str, Batch] = {}
        for child in sorted(directory.iterdir()):
            if not child.is_dir():
                continue
            try:
                data = (child / "log").read_bytes()
            except OSError:
                data = b""
            decoded = decode(data)
            state = replay(decoded)
            if state is None or state.created.get("id") != child.name:
                log.warning("batches: removing %s (its creation never became durable)", child.name)
                shutil.rmtree(child, ignore_errors=True)
                continue
            if decoded.good_end != len(data):
                log.warning("batches: %s: a torn record at the log's end (%d bytes) is dropped", child.name,
                            len(data) - decoded.good_end)
            batches[child.name] = Batch(child, state, decoded.good_end)
        return cls(directory, batches)

    async def create(self, created: dict[str, Any], input_file: Path) -> Batch:
        """A new batch, durable on return: its directory, its input's link, its ``created`` record."""
        bid = str(created["id"])
        target = self.directory / bid
        await trio.to_thread.run_sync(self._create, target, input_file, encode(created))
        state = replay(decode(encode(created)))
        assert state is not None
        batch = Batch(target, state, len(encode(created)))
        self.batches[bid] = batch
        return batch

    def _create(self, target: Path, input_file: Path, first: bytes) -> None:
        target.mkdir(mode=0o700)
        try:
            os.link(input_file, target / "input.jsonl")
        except OSError:  # another filesystem, or no links there: a copy
            shutil.copyfile(input_file, target / "input.jsonl")
            os.chmod(target / "input.jsonl", 0o600)
        fd = os.open(target / "log", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, first)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(target)
        fsync_dir(self.directory)

    def of(self, tenant: str, bid: str) -> Batch | None:
        """The batch ``bid`` if ``tenant`` owns it (another tenant's is None, as an unknown id)."""
        batch = self.batches.get(bid)
        return batch if batch is not None and batch.tenant == tenant else None


def _split(path: Path, max_line: int) -> Iterator[bytes | None]:
    """The file's non-blank lines; None for one longer than ``max_line`` bytes."""
    with open(path, "rb") as f:
        buf = bytearray()
        skipping = False
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                break
            buf += chunk
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    if len(buf) > max_line and not skipping:
                        skipping = True
                        yield None
                    if skipping:
                        buf.clear()
                    break
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                if skipping:
                    skipping = False
                    continue
                if len(line) > max_line:
                    yield None
                elif line.strip():
                    yield line
        if buf.strip() and not skipping:
            yield bytes(buf) if len(buf) <= max_line else None


async def input_lines(path: Path, max_line: int, *, per_read: int = 64) -> AsyncIterator[tuple[int, bytes | None]]:
    """``(index, line)`` for each non-blank line of ``path`` (None: over ``max_line`` bytes),
    read in a thread ``per_read`` lines at a time."""
    it = _split(path, max_line)
    index = 0

    def take() -> list[bytes | None]:
        out: list[bytes | None] = []
        for line in it:
            out.append(line)
            if len(out) >= per_read:
                break
        return out

    while True:
        lines = await trio.to_thread.run_sync(take)
        if not lines:
            return
        for line in lines:
            await trio.lowlevel.checkpoint()  # the runner's feed is cancellable between lines (ASYNC911)
            yield index, line
            index += 1
