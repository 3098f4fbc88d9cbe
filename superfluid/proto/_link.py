"""``WorkerLink``: the sans-I/O worker link (framing + state machine).

Bytes in, events out, and back; no sockets, no clocks. Both ends use the same
class with a different ``our_role``: a message we send that the protocol
forbids raises :class:`LocalProtocolError`; one the peer sends raises
:class:`RemoteProtocolError`, and the link is then in ``ERROR`` for good.
"""

from __future__ import annotations

from typing import Final

import attrs

from ._errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ._events import (
    Admit, Admitted, Cancel, Embed, Embedded, Emit, Event, Fault, SlotAction, SlotDone, Tick, TickDone, Tokenize, Tokenized,
    from_wire, to_wire,
)
from ._frames import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame
from ._state import CLOSED, CLOSING, DAEMON, ERROR, IDLE, TRANSITIONS, WORKER, _Sentinel

__all__ = ["MAX_TICKS_IN_FLIGHT", "NEED_DATA", "LinkStatistics", "WorkerLink"]

# one tick running and one queued behind it: the daemon plans tick N+1 while
# tick N runs, so the engine never idles waiting for the daemon
MAX_TICKS_IN_FLIGHT = 2


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


@attrs.frozen(kw_only=True)
class LinkStatistics:
    state: str
    open_lanes: int
    pending_tokenize: int
    tick_running: bool
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    dropped: int
    buffered: int


class WorkerLink:
    def __init__(self, our_role: _Sentinel, *, max_frame_size: int = DEFAULT_MAX_FRAME) -> None:
        if our_role not in (DAEMON, WORKER):
            raise ValueError("our_role must be DAEMON or WORKER")
        self.our_role = our_role
        self.their_role = WORKER if our_role is DAEMON else DAEMON
        self.max_frame_size = max_frame_size
        self.state: _Sentinel = IDLE
        self._decoder = FrameDecoder(max_frame_size=max_frame_size)
        self._lanes: dict[int, bool] = {}  # lane -> cancelling?
        self._pending_tokenize: set[int] = set()
        self._pending_embed: set[int] = set()
        self._ticks_in_flight = 0
        self._frames_in = self._frames_out = self._bytes_in = self._bytes_out = self._dropped = 0

    # -- sending -------------------------------------------------------------

    def send(self, event: Event) -> bytes:
        """Validate ``event`` as ours and return its framed bytes.

        Raises:
            LocalProtocolError: the protocol forbids it now, or it cannot be framed;
                a refused send changes nothing.
        """
        try:
            data = encode_frame(to_wire(event), max_frame_size=self.max_frame_size)
        except (TypeError, ValueError, OverflowError) as exc:
            raise LocalProtocolError(f"cannot encode {type(event).__name__}: {exc}") from None
        self._apply(self.our_role, event, LocalProtocolError)
        self._frames_out += 1
        self._bytes_out += len(data)
        return data

    def send_failed(self) -> None:
        """The transport failed while sending; the link can carry nothing more."""
        self.state = ERROR

    # -- receiving -----------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; ``b""`` means EOF."""
        self._bytes_in += len(data)
        try:
            self._decoder.receive_data(data)
        except RemoteProtocolError:
            self.state = ERROR
            raise

    def next_event(self) -> Event | _NeedData:
        """Return the next peer event, or ``NEED_DATA``.

        Raises:
            RemoteProtocolError: the peer broke framing, encoding or the state table.
        """
        if self.state is ERROR:
            raise RemoteProtocolError("the link is in ERROR")
        while True:
            try:
                body = self._decoder.next_frame()
                if body is None:
                    if self._decoder.at_eof and self.state is CLOSING:
                        self.state = CLOSED  # EOF at a frame boundary after Shutdown: a clean close
                    elif self._decoder.at_eof and self.state is not CLOSED:
                        raise RemoteProtocolError(f"peer closed the link in state {self.state!r}")
                    return NEED_DATA
                self._frames_in += 1
                event = from_wire(body, max_len=self.max_frame_size)
                if event is None:
                    self._dropped += 1
                    continue
                self._apply(self.their_role, event, RemoteProtocolError)
                return event
            except ProtocolError:
                self.state = ERROR
                raise

    # -- the table -------------------------------------------------------------

    def _apply(self, sender: _Sentinel, event: Event, error: type[ProtocolError]) -> None:
        if self.state is ERROR:
            raise error("the link is in ERROR")
        new_state = TRANSITIONS.get((self.state, sender, type(event)))
        if new_state is None:
            raise error(f"{sender!r} may not send {type(event).__name__} in state {self.state!r}")
        self._check_conversation(sender, event, error)
        self.state = new_state

    def _check_conversation(self, sender: _Sentinel, event: Event, error: type[ProtocolError]) -> None:
        lanes = self._lanes
        if isinstance(event, Admit):
            if event.lane in lanes:
                raise error(f"lane {event.lane} is already open")
            lanes[event.lane] = False
        elif isinstance(event, Cancel):
            if event.lane in lanes:
                lanes[event.lane] = True
        elif isinstance(event, Tokenize):
            if event.req in self._pending_tokenize:
                raise error(f"tokenize request {event.req} is already pending")
            self._pending_tokenize.add(event.req)
        elif isinstance(event, Tokenized):
            if event.req not in self._pending_tokenize:
                raise error(f"answer to unknown tokenize request {event.req}")
            if not event.more:
                self._pending_tokenize.discard(event.req)
        elif isinstance(event, Embed):
            if event.req in self._pending_embed:
                raise error(f"embed request {event.req} is already pending")
            self._pending_embed.add(event.req)
        elif isinstance(event, Embedded):
            if event.req not in self._pending_embed:
                raise error(f"answer to unknown embed request {event.req}")
            if not event.more:
                self._pending_embed.discard(event.req)
        elif isinstance(event, SlotAction):   # shares the tokenizes' ids (sched/_core.py)
            if event.req in self._pending_tokenize:
                raise error(f"slot request {event.req} is already pending")
            self._pending_tokenize.add(event.req)
        elif isinstance(event, SlotDone):
            if event.req not in self._pending_tokenize:
                raise error(f"answer to unknown slot request {event.req}")
            self._pending_tokenize.discard(event.req)
        elif isinstance(event, Tick):
            if self._ticks_in_flight >= MAX_TICKS_IN_FLIGHT:
                raise error(f"{MAX_TICKS_IN_FLIGHT} ticks are already in flight")
            self._ticks_in_flight += 1
        elif isinstance(event, TickDone):
            if not self._ticks_in_flight:
                raise error("TickDone without a running tick")
            self._ticks_in_flight -= 1
        elif isinstance(event, Admitted):
            if event.lane not in lanes:
                raise error(f"Admitted for unknown lane {event.lane}")
        elif isinstance(event, Emit):
            for lane, _tok, _piece, finish, *_rest in event.items:
                if lane not in lanes:
                    raise error(f"Emit for unknown lane {lane}")
                if finish is not None:
                    del lanes[lane]
        elif isinstance(event, Fault):
            if event.lane >= 0:
                if event.lane not in lanes:
                    raise error(f"Fault for unknown lane {event.lane}")
                del lanes[event.lane]

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(
            state=repr(self.state),
            open_lanes=len(self._lanes),
            pending_tokenize=len(self._pending_tokenize),
            tick_running=self._ticks_in_flight > 0,
            frames_in=self._frames_in,
            frames_out=self._frames_out,
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            dropped=self._dropped,
            buffered=self._decoder.buffered,
        )
