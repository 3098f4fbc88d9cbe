"""The worker link's state machine, as data (after h11's ``_state.py``).

The link has one connection state shared by both roles. ``TRANSITIONS`` maps
``(state, sender, message type)`` to the next state; a message absent from the
table for the current state is a protocol error, blamed on whoever sent it.
The table is mirrored in SPEC.md (a test checks the two agree).

Beside the connection state, the link tracks three small per-conversation
facts the table cannot express: which lanes are open (or cancelling), which
tokenize requests await an answer, and whether a tick is running.
"""

from __future__ import annotations

from typing import Final

from ._events import (
    Admit,
    Admitted,
    Cancel,
    Embed,
    Embedded,
    Emit,
    Event,
    Fault,
    Hello,
    HelloAck,
    Interrupt,
    LoadFailed,
    Shutdown,
    Telemetry,
    Tick,
    TickDone,
    SlotAction,
    SlotDone,
    Tokenize,
    Tokenized,
)

__all__ = ["DAEMON", "WORKER", "IDLE", "HELLO_SENT", "READY", "CLOSING", "CLOSED", "ERROR", "TRANSITIONS"]


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DAEMON: Final = _Sentinel("DAEMON")
WORKER: Final = _Sentinel("WORKER")

IDLE: Final = _Sentinel("IDLE")
HELLO_SENT: Final = _Sentinel("HELLO_SENT")
READY: Final = _Sentinel("READY")
CLOSING: Final = _Sentinel("CLOSING")
CLOSED: Final = _Sentinel("CLOSED")
ERROR: Final = _Sentinel("ERROR")

_READY_FROM_DAEMON = (Tokenize, Admit, Tick, Interrupt, Cancel, Embed, SlotAction)
_READY_FROM_WORKER = (Tokenized, Admitted, Emit, TickDone, Fault, Telemetry, Embedded, SlotDone)

TRANSITIONS: Final[dict[tuple[_Sentinel, _Sentinel, type[Event]], _Sentinel]] = {
    (IDLE, DAEMON, Hello): HELLO_SENT,
    (HELLO_SENT, WORKER, HelloAck): READY,
    (HELLO_SENT, WORKER, LoadFailed): CLOSED,
    (HELLO_SENT, WORKER, Telemetry): HELLO_SENT,
    **{(READY, DAEMON, cls): READY for cls in _READY_FROM_DAEMON},
    **{(READY, WORKER, cls): READY for cls in _READY_FROM_WORKER},
    (READY, DAEMON, Shutdown): CLOSING,
    (HELLO_SENT, DAEMON, Shutdown): CLOSING,
    **{(CLOSING, WORKER, cls): CLOSING for cls in _READY_FROM_WORKER},
}
