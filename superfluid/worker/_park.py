"""Parked KV: a finished sequence's state kept on disk (``--park``).

When a lane ends and its sequence holds at least ``PARK_MIN_TOKENS`` tokens,
the executor exports the sequence's state (``Engine.seq_export``, on the
engine thread: it touches the context) and hands it to :meth:`ParkStore.put`.
A writer thread writes it to ``<park dir>/<digest>.park``: a temporary file,
fsynced, renamed, fsynced directory, mode 0600. A full writer queue drops the
park (counted ``queue_full``): the engine thread never waits for the disk.

An admission that neither a KV sequence nor the host cache covers asks
:meth:`ParkStore.best` for the artifact of its cache salt whose tokens share
the longest prefix with the prompt (an in-memory index of the directory,
built from the files' headers when the store opens, so it survives worker
and daemon restarts), reads it with :meth:`ParkStore.load`, which checks
everything before the engine sees a byte, and imports it.

The file::

    MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | payload

The header holds the format version, the digest, a hash of the cache salt,
the identity (model file, runtime build, KV layout and type), the exact token
ids, and the payload's length and SHA-256. The digest is SHA-256 over (cache
salt, identity, tokens): :meth:`load` recomputes it from the *requesting*
salt and this worker's identity, so an artifact of another tenant, model or
build can never be imported, whatever its header says. A short, torn or
altered file is refused, counted by reason and deleted; the lane prefills
instead (never wrong text).

The directory stays within its byte budget: after each write the least
recently used artifacts (restores touch their file's mtime) are deleted.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from .._private import DIR_MODE, FILE_MODE, fsync_dir, make_private_dir
from ._hostcache import common_prefix

__all__ = ["PARK_MIN_TOKENS", "ParkEntry", "ParkRefused", "ParkStore", "park_digest"]

MAGIC = b"SFPARK\x00\x01"
VERSION = 1
PARK_MIN_TOKENS = 256          # a shorter sequence prefills faster than it parks and restores
MAX_HEADER = 64 << 20          # a header longer than this is not ours
QUEUE_ITEMS = 4                # parks waiting for the writer; more are dropped
SUFFIX = ".park"
SLOTS = "slots"                # llama-server's slot files, named by the client (POST /slots/{id})
TMP_STALE_S = 600.0            # a temporary file this old is a crashed writer's
_LEN = struct.Struct("<I")

# fallback reasons (superfluid_park_fallbacks_total{reason})
REASONS = ("missing", "torn", "checksum", "foreign", "import", "queue_full", "write_error", "unsupported")


class ParkRefused(Exception):
    """An artifact that cannot be used; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def park_digest(salt: str, identity: str, tokens: list[int]) -> str:
    h = hashlib.sha256(b"superfluid-park\x00")
    for part in (salt.encode(), identity.encode()):
        h.update(_LEN.pack(len(part)))
        h.update(part)
    h.update(array.array("I", tokens).tobytes())
    return h.hexdigest()


def salt_key(salt: str) -> str:
    """What a header and the index keep of a cache salt (not the salt itself)."""
    return hashlib.sha256(b"superfluid-park-salt\x00" + salt.encode()).hexdigest()


@attrs.define(eq=False)
class ParkEntry:
    digest: str
    salt: str          # salt_key of the cache salt
    tokens: list[int]
    size: int          # the file's bytes
    last_use: float
    usable: bool = True   # this worker's identity (other models' artifacts count toward the budget only)


class ParkStore:
    """The park directory of one worker: its index, its writer thread and its counts."""

    def __init__(self, directory: Path, budget_bytes: int, identity: str, *,
                 min_tokens: int = PARK_MIN_TOKENS, drop_covered: bool = True, queue_items: int = QUEUE_ITEMS) -> None:
        self.dir = Path(directory)
        self.budget_bytes = budget_bytes
        self.identity = identity
        self.min_tokens = min_tokens
        self.drop_covered = drop_covered   # a longer artifact replaces the ones it extends (per-sequence KV)
        self._lock = threading.Lock()
        self._entries: dict[str, ParkEntry] = {}
        self._pending: dict[str, tuple[str, list[int]]] = {}    # digest -> (salt key, tokens), queued
        self.stats: dict[str, Any] = {"parks": 0, "resumes": 0, "resume_tokens": 0, "restore_s": 0.0, "export_s": 0.0,
                                      "evicted": 0, "bytes": 0, "fallbacks": {}}
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_items))
        # called by the writer thread after each write (the worker reports its counts at once:
        # a park lands after the lane's last tick, and an idle model runs no tick to report it)
        self.on_change: Callable[[], None] | None = None
        make_private_dir(self.dir)
        os.chmod(self.dir, DIR_MODE)
        self._scan()
        self._evict()
        self._writer = threading.Thread(target=self._write_loop, name="park-writer", daemon=True)
        self._writer.start()

    # -- the index ---------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the directory from headers only; delete what is not a park file of ours
        to read (torn, foreign format) and temporary files a crashed writer left."""
        now = time.time()
        for path in self.dir.iterdir():
            name = path.name
            if name.endswith(".tmp"):
                try:
                    if now - path.stat().st_mtime > TMP_STALE_S:
                        path.unlink()
                except OSError:
                    pass
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                header, _offset, size, mtime = _read_header(path)
            except ParkRefused as exc:
                self._count(exc.reason)
                _unlink(path)
                continue
            except OSError:
                continue
            digest = name[: -len(SUFFIX)]
            if header.get("digest") != digest:
                self._count("torn")
                _unlink(path)
                continue
            self._entries[digest] = ParkEntry(
                digest=digest, salt=str(header.get("salt", "")), tokens=list(header.get("tokens", [])), size=size,
                last_use=mtime, usable=header.get("identity") == self.identity)
        self.stats["bytes"] = sum(e.size for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return int(self.stats["bytes"])

    def wants(self, tokens: list[int], salt: str) -> bool:
        """Whether ``tokens`` (a released sequence's) is worth parking: long enough, and
        no artifact of ``salt`` (written or queued) holds all of it already."""
        if self.budget_bytes <= 0 or len(tokens) < self.min_tokens:
            return False
        key = salt_key(salt)
        with self._lock:
            for e in self._entries.values():
                if e.usable and e.salt == key and _covers(e.tokens, tokens):
                    e.last_use = time.time()   # still wanted: it is not the oldest any more
                    return False
            return not any(s == key and _covers(t, tokens) for s, t in self._pending.values())

    def put(self, tokens: list[int], salt: str, data: Any) -> bool:
        """Queue ``data`` (the exported state of ``tokens``) for the writer; False (counted
        ``queue_full``) if the writer is behind. ``data`` is not copied: the caller hands it over."""
        try:
            memoryview(data)
        except TypeError:   # a runtime whose state is no byte buffer (MLX's arrays): nothing to write
            self._count("unsupported")
            return False
        if len(data) + 4096 > self.budget_bytes:
            return False
        digest = park_digest(salt, self.identity, tokens)
        key = salt_key(salt)
        with self._lock:
            if digest in self._pending:
                return False
            try:
                self._queue.put_nowait((digest, key, list(tokens), data))
            except queue.Full:
                self._count_locked("queue_full")
                return False
            self._pending[digest] = (key, list(tokens))
        return True

    def best(self, tokens: list[int], limit: int, salt: str, *, whole: bool) -> tuple[ParkEntry, int] | None:
        """The usable artifact of ``salt`` sharing the longest prefix with ``tokens`` (at most
        ``limit``): ``(entry, shared)``, or None. ``whole``: only artifacts that are entirely
        a prefix of ``tokens`` count (a shared pool cannot trim an imported sequence)."""
        key = salt_key(salt)
        found: tuple[ParkEntry, int] | None = None
        with self._lock:
            for entry in self._entries.values():
                if not entry.usable or entry.salt != key:
                    continue
                n = common_prefix(entry.tokens, tokens, limit)
                if whole and n < len(entry.tokens):
                    continue
                if n and (found is None or n > found[1]):
                    found = (entry, n)
        return found

    def load(self, entry: ParkEntry, salt: str) -> bytearray:
        """Read and check ``entry``'s file for a lane of ``salt``: its state's bytes.

        Raises:
            ParkRefused: the file is gone (``missing``), short or unreadable (``torn``), its
                payload differs from its hash (``checksum``), or it was not computed for this
                salt, model, runtime build and these tokens (``foreign``). Every reason but
                ``missing`` deletes the file; each is counted.
        """
        path = self.dir / (entry.digest + SUFFIX)
        try:
            try:
                with open(path, "rb") as f:
                    header, offset = _parse_header(f, path)
                    want = int(header.get("payload_bytes", -1))
                    f.seek(offset)
                    payload = bytearray(max(0, want))
                    got = f.readinto(payload) if want > 0 else 0
                    if got == want and f.read(1):
                        got += 1   # longer than its header says
            except FileNotFoundError:
                raise ParkRefused("missing") from None
            except OSError as exc:
                raise ParkRefused("torn", str(exc)) from None
            tokens = header.get("tokens")
            if (not isinstance(tokens, list) or header.get("digest") != entry.digest
                    or park_digest(salt, self.identity, tokens) != entry.digest or tokens != entry.tokens):
                raise ParkRefused("foreign")
            if want < 0 or got != want:
                raise ParkRefused("torn", f"payload of {got} bytes, header says {want}")
            if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
                raise ParkRefused("checksum")
        except ParkRefused as exc:
            self.refuse(entry, exc.reason)
            raise
        with self._lock:
            entry.last_use = time.time()
        try:
            os.utime(path)
        except OSError:
            pass
        return payload

    # -- llama-server's slot files (POST /slots/{id}?action=save|restore) ------------------

    def save_named(self, name: str, tokens: list[int], salt: str, data: Any) -> int:
        """Write ``data`` (the state of ``tokens``) to ``slots/<name>`` now, in the park format
        (this worker's identity, ``salt``'s key); the bytes written. Outside the budget and
        the index: a client names and keeps these files."""
        memoryview(data)   # TypeError: no bytes to write (the caller checked the runtime parks)
        slots = self.dir / SLOTS
        make_private_dir(slots)
        return self._write(park_digest(salt, self.identity, tokens), salt_key(salt), list(tokens), data,
                           path=slots / name)

    def load_named(self, name: str, salt: str) -> tuple[list[int], bytearray]:
        """Read and check ``slots/<name>`` for a sequence of ``salt``: (tokens, state bytes).

        Raises:
            ParkRefused: ``missing``, ``torn``, ``checksum``, or ``foreign`` (another model,
                build, KV type or tenant). The file is the client's: it is never deleted here.
        """
        path = self.dir / SLOTS / name
        try:
            with open(path, "rb") as f:
                header, offset = _parse_header(f, path)
                want = int(header.get("payload_bytes", -1))
                f.seek(offset)
                payload = bytearray(max(0, want))
                got = f.readinto(payload) if want > 0 else 0
        except FileNotFoundError:
            raise ParkRefused("missing") from None
        except OSError as exc:
            raise ParkRefused("torn", str(exc)) from None
        tokens = header.get("tokens")
        if not isinstance(tokens, list) or park_digest(salt, self.identity, tokens) != header.get("digest"):
            raise ParkRefused("foreign")
        if want < 0 or got != want:
            raise ParkRefused("torn", f"payload of {got} bytes, header says {want}")
        if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
            raise ParkRefused("checksum")
        return tokens, payload

    def refuse(self, entry: ParkEntry, reason: str) -> None:
        """Count a fallback and forget ``entry`` (its file deleted unless it was missing)."""
        with self._lock:
            self._count_locked(reason)
            self._forget_locked(entry.digest)
        if reason != "missing":
            _unlink(self.dir / (entry.digest + SUFFIX))

    def exported(self, seconds: float) -> None:
        """An export for a park took ``seconds`` of the engine thread."""
        with self._lock:
            self.stats["export_s"] += seconds

    def resumed(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.stats["resumes"] += 1
            self.stats["resume_tokens"] += tokens
            self.stats["restore_s"] += seconds

    def snapshot(self) -> dict[str, Any]:
        """The counts so far (cumulative for this worker), for the daemon's metrics."""
        with self._lock:
            return {**self.stats, "fallbacks": dict(self.stats["fallbacks"]), "artifacts": len(self._entries)}

    def telemetry(self) -> dict[str, float]:
        """:meth:`snapshot` flattened for a ``Telemetry`` event (``park.<count>``,
        ``park.fallback.<reason>``; sched/_core.py reads it back)."""
        snap = self.snapshot()
        out = {f"park.{k}": float(v) for k, v in snap.items() if k != "fallbacks"}
        out.update({f"park.fallback.{r}": float(n) for r, n in snap["fallbacks"].items()})
        return out

    def _count(self, reason: str) -> None:
        with self._lock:
            self._count_locked(reason)

    def _count_locked(self, reason: str) -> None:
        fb = self.stats["fallbacks"]
        fb[reason] = fb.get(reason, 0) + 1

    def _forget_locked(self, digest: str) -> None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self.stats["bytes"] -= entry.size

    # -- the writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            digest, key, tokens, data = item
            try:
                size = self._write(digest, key, tokens, data)
            except Exception:  # noqa: BLE001 - boundary: a failed write drops that park, never the writer
                with self._lock:
                    self._pending.pop(digest, None)
                    self._count_locked("write_error")
                continue
            finally:
                del data, item
            covered: list[str] = []
            with self._lock:
                self._pending.pop(digest, None)
                self._forget_locked(digest)
                if self.drop_covered:
                    covered = [d for d, e in self._entries.items()
                               if e.usable and e.salt == key and _covers(tokens, e.tokens)]
                    for d in covered:
                        self._forget_locked(d)
                self._entries[digest] = ParkEntry(digest=digest, salt=key, tokens=tokens, size=size,
                                                  last_use=time.time())
                self.stats["bytes"] += size
                self.stats["parks"] += 1
            for d in covered:
                _unlink(self.dir / (d + SUFFIX))
            self._evict()
            if self.on_change is not None:
                self.on_change()

    def _write(self, digest: str, key: str, tokens: list[int], data: Any, *, path: Path | None = None) -> int:
        view = memoryview(data).cast("B")
        header = json.dumps({
            "version": VERSION, "digest": digest, "salt": key, "identity": self.identity, "tokens": tokens,
            "payload_bytes": len(view), "payload_sha256": hashlib.sha256(view).hexdigest(),
        }, separators=(",", ":")).encode()
        path = path or self.dir / (digest + SUFFIX)
        tmp = path.parent / f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(view)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        fsync_dir(path.parent)
        return len(MAGIC) + _LEN.size + len(header) + len(view)

    def _evict(self) -> None:
        """Delete the least recently used artifacts until the directory is within budget."""
        gone: list[str] = []
        with self._lock:
            if self.stats["bytes"] <= self.budget_bytes:
                return
            for entry in sorted(self._entries.values(), key=lambda e: e.last_use):
                if self.stats["bytes"] <= self.budget_bytes:
                    break
                self._forget_locked(entry.digest)
                self.stats["evicted"] += 1
                gone.append(entry.digest)
        for d in gone:
            _unlink(self.dir / (d + SUFFIX))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued park is written (tests; a clean shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return
            time.sleep(0.005)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (within ``timeout``), then stop the writer."""
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return
        self._writer.join(timeout)


def _parse_header(f: Any, path: Path) -> tuple[dict[str, Any], int]:
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) < len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
        raise ParkRefused("torn", f"{path.name}: not a park file")
    (n,) = _LEN.unpack(head[len(MAGIC):])
    if n > MAX_HEADER:
        raise ParkRefused("torn", f"{path.name}: header of {n} bytes")
    raw = f.read(n)
    if len(raw) != n:
        raise ParkRefused("torn", f"{path.name}: short header")
    try:
        header = json.loads(raw)
    except ValueError:
        raise ParkRefused("torn", f"{path.name}: unreadable header") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise ParkRefused("torn", f"{path.name}: unknown version")
    return header, len(head) + n


def _read_header(path: Path) -> tuple[dict[str, Any], int, int, float]:
    """(header, payload offset, file size, mtime); a payload shorter than the header says is torn."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        header, offset = _parse_header(f, path)
    if st.st_size != offset + int(header.get("payload_bytes", -1)):
        raise ParkRefused("torn", f"{path.name}: {st.st_size} bytes")
    return header, offset, st.st_size, st.st_mtime


def _covers(longer: list[int], shorter: list[int]) -> bool:
    return len(longer) >= len(shorter) and longer[: len(shorter)] == shorter


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
