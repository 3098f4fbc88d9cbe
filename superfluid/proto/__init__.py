"""Pure protocol code: worker-link framing and messages, the link state
machine, SSE/NDJSON encoders. No I/O, no trio, no clocks."""

from __future__ import annotations

from ._errors import LocalProtocolError as LocalProtocolError
from ._errors import ProtocolError as ProtocolError
from ._errors import RemoteProtocolError as RemoteProtocolError
from ._events import FINISH_REASONS as FINISH_REASONS
from ._events import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._events import TOKENIZED_PIECE as TOKENIZED_PIECE
from ._events import Admit as Admit
from ._events import Admitted as Admitted
from ._events import Cancel as Cancel
from ._events import EMBEDDED_PIECE_BYTES as EMBEDDED_PIECE_BYTES
from ._events import Embed as Embed
from ._events import Embedded as Embedded
from ._events import Emit as Emit
from ._events import Event as Event
from ._events import FAULT_BUG as FAULT_BUG
from ._events import Fault as Fault
from ._events import Hello as Hello
from ._events import HelloAck as HelloAck
from ._events import Interrupt as Interrupt
from ._events import LoadFailed as LoadFailed
from ._events import Sampling as Sampling
from ._events import Shutdown as Shutdown
from ._events import Telemetry as Telemetry
from ._events import Tick as Tick
from ._events import TickDone as TickDone
from ._events import Tokenize as Tokenize
from ._events import Tokenized as Tokenized
from ._events import from_wire as from_wire
from ._events import to_wire as to_wire
from ._events import embedded_pieces as embedded_pieces
from ._events import tokenized_pieces as tokenized_pieces
from ._frames import DEFAULT_MAX_FRAME as DEFAULT_MAX_FRAME
from ._frames import FrameDecoder as FrameDecoder
from ._frames import encode_frame as encode_frame
from ._link import MAX_TICKS_IN_FLIGHT as MAX_TICKS_IN_FLIGHT
from ._link import NEED_DATA as NEED_DATA
from ._link import LinkStatistics as LinkStatistics
from ._link import WorkerLink as WorkerLink
from ._spec import MAX_DRAFT_DEPTH as MAX_DRAFT_DEPTH
from ._spec import SPEC_DIRECTIVES as SPEC_DIRECTIVES
from ._spec import SPEC_FLAGS as SPEC_FLAGS
from ._spec import SpecConfig as SpecConfig
from ._sse import SSE_DONE as SSE_DONE
from ._sse import SSE_PING as SSE_PING
from ._sse import SseDecoder as SseDecoder
from ._sse import SseEvent as SseEvent
from ._sse import SseLineTooLong as SseLineTooLong
from ._sse import encode_ndjson as encode_ndjson
from ._sse import encode_sse as encode_sse
from ._sse import encode_sse_json as encode_sse_json
from ._state import DAEMON as DAEMON
from ._state import TRANSITIONS as TRANSITIONS
from ._state import WORKER as WORKER
