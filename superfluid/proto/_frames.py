"""Length-prefixed framing: ``u32 big-endian length | msgpack body``.

The length is checked against ``max_frame_size`` before a byte of the body is
buffered, so a hostile or broken peer can never make us hold more than one
frame's worth of memory.
"""

from __future__ import annotations

import struct

from ._errors import LocalProtocolError, RemoteProtocolError

__all__ = ["DEFAULT_MAX_FRAME", "FrameDecoder", "encode_frame"]

DEFAULT_MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


def encode_frame(body: bytes, *, max_frame_size: int = DEFAULT_MAX_FRAME) -> bytes:
    if len(body) > max_frame_size:
        raise LocalProtocolError(f"frame of {len(body)} bytes exceeds {max_frame_size}")
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Splits a byte stream into frame bodies. Feed bytes, then pull frames."""

    def __init__(self, *, max_frame_size: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._eof = False

    def receive_data(self, data: bytes) -> None:
        if self._eof and data:
            raise RemoteProtocolError("data after EOF")
        if not data:
            self._eof = True
            return
        self._buf += data

    def next_frame(self) -> bytes | None:
        """Return the next complete body, or ``None`` if more bytes are needed.

        Raises:
            RemoteProtocolError: an oversized frame, or EOF inside a frame.
        """
        if len(self._buf) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buf)
            if length > self.max_frame_size:
                raise RemoteProtocolError(
                    f"frame of {length} bytes exceeds the {self.max_frame_size}-byte limit"
                )
            end = _HEADER.size + length
            if len(self._buf) >= end:
                body = bytes(self._buf[_HEADER.size : end])
                del self._buf[:end]
                return body
        if self._eof and self._buf:
            raise RemoteProtocolError(f"EOF inside a frame ({len(self._buf)} bytes pending)")
        return None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._buf
