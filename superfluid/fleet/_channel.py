"""The fleet link's encrypted channel: Noise over one TCP stream, keyed by the fleet token.

``Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`` with the 32-byte token as psk0 (``noiseprotocol`` does
the cryptography; nothing here is home-made): two messages, fresh ephemeral keys each side, and a
peer without the token fails the first message. ``--insecure-no-auth`` (key ``None``) is plain
``Noise_NN``: still encrypted, not authenticated; the mode is in the prologue, so the modes never meet.

Wire: ``u16 big-endian length | noise message``, for the handshake and for every record. A
record's plaintext is ``type byte | payload``: 0 data, 1 keepalive, 2 close. The reader holds at
most one frame (65537 bytes); every byte arriving renews the lease, and ``lease_s`` without one
is :class:`ChannelLost`. One writer lock keeps records whole and their nonces in wire order; a
send torn by cancellation or a failed record loses the channel (its nonces cannot resync).
"""

from __future__ import annotations

import math
import os
import pathlib
import secrets
import string
import struct

import trio
from cryptography.exceptions import InvalidTag
from noise.connection import NoiseConnection
from noise.exceptions import NoiseHandshakeError, NoiseInvalidMessage, NoiseValueError

__all__ = ["LEASE_S", "PROLOGUE", "PROTOCOL_NAME", "Channel", "ChannelLost", "HandshakeFailed", "ensure_token",
           "handshake", "load_token", "new_token", "parse_token", "token_path"]

PROLOGUE = b"superfluid-fleet/1"
PROTOCOL_NAME = b"Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s"
INSECURE_PROTOCOL_NAME = b"Noise_NN_25519_ChaChaPoly_BLAKE2s"
LEASE_S = 6.0
KEEPALIVE_MAX_S = 0.5     # a keepalive at least this often: a peer's lease of 1.5 s or more holds
CLOSE_GRACE_S = 1.0

_HEADER = struct.Struct(">H")
_MAX_MESSAGE = 65535                        # a Noise message, the 16-byte tag included
_MAX_FRAME = _HEADER.size + _MAX_MESSAGE
_MAX_CHUNK = _MAX_MESSAGE - 16 - 1          # data bytes per record (the type byte and tag aside)
_DATA, _KEEPALIVE, _CLOSE = 0, 1, 2
_NOISE_ERRORS = (InvalidTag, NoiseInvalidMessage, NoiseHandshakeError, NoiseValueError, ValueError)


class HandshakeFailed(Exception):
    """The handshake did not complete: another token or mode, garbage, EOF or a timeout."""


class ChannelLost(Exception):
    """The channel is gone: lease expired, a bad or torn record, EOF without a close, a transport error."""


def new_token() -> str:
    return secrets.token_hex(32)


def parse_token(text: str) -> bytes:
    token = text.strip()
    if len(token) != 64:
        raise ValueError(f"fleet token: expected 64 hex characters, got {len(token)}")
    if not all(c in string.hexdigits for c in token):
        raise ValueError("fleet token: not hexadecimal")
    return bytes.fromhex(token)


def token_path(home: pathlib.Path) -> pathlib.Path:
    return home / "fleet" / "token"


def _read_token(path: pathlib.Path) -> bytes:
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise ValueError(f"fleet token: cannot read {path}: {exc.strerror or exc}") from None
    try:
        return parse_token(text)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {path})") from None


def ensure_token(home: pathlib.Path) -> str:
    """The token under ``home``, created (0600 in a 0700 directory) if there is none yet."""
    path = token_path(home)
    if path.exists():
        return _read_token(path).hex()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    token = new_token()
    tmp = path.with_name(f".token.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)      # atomic, and never over a token another process made meanwhile
        except FileExistsError:
            return _read_token(path).hex()
        except OSError:             # a filesystem without hard links
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return token


def load_token(value: str | None, home: pathlib.Path) -> bytes | None:
    """The fleet key from ``--token`` (64 hex, ``@path`` or a path), else the token file, else ``None``."""
    if value is None:
        path = token_path(home)
        return _read_token(path) if path.exists() else None
    if value.startswith("@"):
        return _read_token(pathlib.Path(value[1:]).expanduser())
    if len(value.strip()) == 64 and all(c in string.hexdigits for c in value.strip()):
        return parse_token(value)
    if pathlib.Path(value).expanduser().is_file():
        return _read_token(pathlib.Path(value).expanduser())
    raise ValueError(f"fleet token: expected 64 hex characters or a token file (got {len(value)} characters, "
                     "no such file)")


class _Reader:
    """Frames from a stream, buffering at most one frame (the lease is per read: bytes renew it)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._buf = bytearray()

    async def frame(self, idle_s: float) -> bytes:
        await self._fill(_HEADER.size, idle_s)
        (length,) = _HEADER.unpack_from(self._buf)
        if length == 0:
            raise ChannelLost("a zero-length frame")
        await self._fill(_HEADER.size + length, idle_s)
        body = bytes(self._buf[_HEADER.size : _HEADER.size + length])
        del self._buf[: _HEADER.size + length]
        return body

    async def _fill(self, n: int, idle_s: float) -> None:
        while len(self._buf) < n:
            with trio.move_on_after(idle_s) as scope:
                chunk = await self._stream.receive_some(_MAX_FRAME - len(self._buf))
            if scope.cancelled_caught:
                raise ChannelLost(f"lease expired: nothing from the peer for {idle_s:g}s")
            if not chunk:
                raise ChannelLost("EOF inside a frame" if self._buf else "the peer closed the connection")
            self._buf += chunk


def _why(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _frame(message: bytes | bytearray) -> bytes:
    return _HEADER.pack(len(message)) + bytes(message)


class Channel:
    """An established channel (from :func:`handshake`). One reader task; writers share a lock."""

    def __init__(self, stream: trio.abc.Stream, noise: NoiseConnection, reader: _Reader, *, lease_s: float,
                 peer: tuple[str, int] | None) -> None:
        self.peer = peer
        self.lease_s = lease_s
        self._stream = stream
        self._noise = noise
        self._reader = reader
        self._send_lock = trio.StrictFIFOLock()
        self._receiving = False
        self._peer_closed = False
        self._closed = False
        self._lost: str | None = None           # why sends and receives now fail
        self._ended = trio.Event()              # lost or closed: the keepalive stops
        self._last_send = trio.current_time()
        self._ops: set[trio.CancelScope] = set()

    def _fail(self, reason: str) -> None:
        """Lost (or closed): the transport closes now, sends and receives fail, the keepalive stops."""
        if self._lost is None:
            self._lost = reason
        self._ended.set()
        socket = getattr(self._stream, "socket", None)
        if socket is not None:
            socket.close()

    async def _write(self, kind: int, payload: bytes) -> None:
        """One record; the caller holds the send lock."""
        await trio.lowlevel.checkpoint_if_cancelled()   # before the nonce is spent
        if self._lost is not None:
            raise ChannelLost(self._lost)
        record = self._noise.encrypt(bytes([kind]) + payload)
        try:
            await self._stream.send_all(_frame(record))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(f"send: {_why(exc)}")
            raise ChannelLost(self._lost) from exc
        except BaseException:   # cancelled: torn or unsent, the peer's nonces cannot follow any more
            self._fail("a send was interrupted")
            raise
        self._last_send = trio.current_time()

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        with trio.CancelScope() as op:
            self._ops.add(op)
            try:
                async with self._send_lock:
                    if self._lost is not None:
                        raise ChannelLost(self._lost)
                    for offset in range(0, len(view), _MAX_CHUNK):
                        await self._write(_DATA, bytes(view[offset : offset + _MAX_CHUNK]))
            finally:
                self._ops.discard(op)
        if op.cancelled_caught:
            raise ChannelLost(self._lost or "aborted")

    async def receive_some(self) -> bytes:
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this channel")
        self._receiving = True
        try:
            with trio.CancelScope() as op:
                self._ops.add(op)
                return await self._receive()
            raise ChannelLost(self._lost or "aborted")
        finally:
            self._ops.discard(op)
            self._receiving = False

    async def _receive(self) -> bytes:
        while not self._peer_closed:
            if self._lost is not None:
                raise ChannelLost(self._lost)
            try:
                plain = self._noise.decrypt(await self._reader.frame(self.lease_s))
                if not plain or plain[0] not in (_DATA, _KEEPALIVE, _CLOSE):
                    raise ChannelLost(f"unknown record type {plain[:1].hex() or 'empty'}")
            except ChannelLost as exc:
                self._fail(str(exc))
                raise
            except (*_NOISE_ERRORS, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._fail("a record failed to decrypt" if isinstance(exc, _NOISE_ERRORS) else f"receive: {_why(exc)}")
                raise ChannelLost(self._lost) from exc
            if plain[0] == _CLOSE:
                self._peer_closed = True
            elif plain[0] == _DATA and len(plain) > 1:
                await trio.lowlevel.cancel_shielded_checkpoint()   # a schedule point, the record kept
                return plain[1:]
        await trio.lowlevel.checkpoint()
        return b""

    async def keepalive(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        interval = min(self.lease_s / 3, KEEPALIVE_MAX_S)   # (the peer's lease may be shorter than ours)
        while not self._ended.is_set():
            with trio.move_on_at(self._last_send + interval):
                await self._ended.wait()
                return
            try:
                async with self._send_lock:
                    if trio.current_time() >= self._last_send + interval:
                        await self._write(_KEEPALIVE, b"")
            except ChannelLost:
                return

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        with trio.move_on_after(CLOSE_GRACE_S, shield=True):
            if self._lost is None:
                try:
                    async with self._send_lock:
                        await self._write(_CLOSE, b"")
                except ChannelLost:
                    pass
        self._fail("the channel is closed")
        with trio.CancelScope(shield=True):
            await self._stream.aclose()

    def abort(self) -> None:
        """Close the transport now, no close record: pending sends and receives raise ChannelLost."""
        self._fail("the channel was aborted")
        for op in self._ops:    # a stream without a socket: its pending operations end here
            op.cancel()


def _peer_of(stream: trio.abc.Stream) -> tuple[str, int] | None:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError, ValueError):
        return None
    return (str(host), int(port))


async def handshake(stream: trio.abc.Stream, key: bytes | None, *, initiator: bool, lease_s: float = LEASE_S,
                    timeout_s: float = 10.0) -> Channel:
    """Authenticate and key the channel (``key`` ``None``: unauthenticated NN). Closes the stream on failure."""
    if key is not None and len(key) != 32:
        raise ValueError("fleet key: 32 bytes expected")
    noise = NoiseConnection.from_name(PROTOCOL_NAME if key is not None else INSECURE_PROTOCOL_NAME)
    noise.set_prologue(PROLOGUE + (b" psk" if key is not None else b" insecure-no-auth"))
    if key is not None:
        noise.set_psks(psk=key)
    if initiator:
        noise.set_as_initiator()
    else:
        noise.set_as_responder()
    noise.start_handshake()
    reader = _Reader(stream)
    failure: str | None = None
    try:
        with trio.fail_after(timeout_s):
            if initiator:
                await stream.send_all(_frame(noise.write_message()))
            if noise.read_message(await reader.frame(math.inf)):     # the payloads are empty: NN meeting
                raise NoiseInvalidMessage("a handshake payload")      # psk sees the tag as one
            if not initiator:
                await stream.send_all(_frame(noise.write_message()))
    except trio.TooSlowError:
        failure = f"fleet handshake timed out after {timeout_s:g}s"
    except _NOISE_ERRORS:
        failure = ("fleet handshake: the peer's message does not authenticate (another fleet token, or "
                   "--insecure-no-auth on one side only)")
    except ChannelLost as exc:
        failure = f"fleet handshake: {exc} (another fleet token, or --insecure-no-auth on one side only?)"
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        failure = f"fleet handshake: transport: {_why(exc)}"
    finally:
        if failure is not None or not noise.handshake_finished:
            with trio.move_on_after(CLOSE_GRACE_S, shield=True):
                await trio.aclose_forcefully(stream)
    if failure is not None:
        raise HandshakeFailed(failure)
    return Channel(stream, noise, reader, lease_s=lease_s, peer=_peer_of(stream))
