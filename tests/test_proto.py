"""The worker link: messages, framing, the state table, and SSE encoding.

Two links talk to each other through a ``LinkPair`` (after h11's
``ConnectionPair``); nothing here does I/O.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superfluid.proto import (
    DAEMON,
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    PROTOCOL_VERSION,
    SSE_DONE,
    SSE_PING,
    TRANSITIONS,
    WORKER,
    Admit,
    Admitted,
    Cancel,
    Embed,
    SlotAction,
    SlotDone,
    Embedded,
    Emit,
    Event,
    Fault,
    Hello,
    HelloAck,
    Interrupt,
    LoadFailed,
    LinkStatistics,
    LocalProtocolError,
    RemoteProtocolError,
    Sampling,
    Shutdown,
    Telemetry,
    Tick,
    TickDone,
    Tokenize,
    Tokenized,
    WorkerLink,
    encode_frame,
    encode_ndjson,
    encode_sse,
    encode_sse_json,
    from_wire,
    to_wire,
)
from superfluid.proto._state import CLOSED, CLOSING, ERROR, HELLO_SENT, IDLE, READY

SPEC = Path(__file__).resolve().parent.parent / "SPEC.md"
STATE_ORDER = (IDLE, HELLO_SENT, READY, CLOSING, CLOSED, ERROR)
HYPOTHESIS = settings(database=None, deadline=None, max_examples=100)


def tick(seq: int = 1, **kw: Any) -> Tick:
    return Tick(seq=seq, **{"prefill_budget": 512, "max_rounds": 8, "time_budget_ms": 50, **kw})


def hello_ack(**kw: Any) -> HelloAck:
    return HelloAck(**{"version": PROTOCOL_VERSION, "runtime": "mock", "runtime_version": "0.1.0", **kw})


def admit(lane: int, tokens: tuple[int, ...] = (1, 2, 3), **kw: Any) -> Admit:
    return Admit(lane=lane, tokens=tokens, **{"n_prompt": len(tokens), "max_new": 8, **kw})


def row(lane: int, token: int = 42, piece: bytes = b" the", finish: str | None = None) -> list[Any]:
    return [lane, token, piece, finish, None]


def frame(code: int, payload: Any) -> bytes:
    """A well-framed body holding whatever ``[code, payload]`` packs to."""
    return encode_frame(msgpack.packb([code, payload], use_bin_type=True))


def get_all_events(link: WorkerLink) -> list[Event]:
    got = []
    while True:
        event = link.next_event()
        if event is NEED_DATA:
            return got
        got.append(event)


def receive_and_get(link: WorkerLink, data: bytes) -> list[Event]:
    link.receive_data(data)
    return get_all_events(link)


def conversation_state(s: LinkStatistics) -> tuple[Any, ...]:
    return (s.state, s.open_lanes, s.pending_tokenize, s.tick_running)


class LinkPair:
    """Two links, DAEMON and WORKER, each fed what the other sends."""

    def __init__(self) -> None:
        self.daemon = WorkerLink(DAEMON)
        self.worker = WorkerLink(WORKER)

    def link(self, role: object) -> WorkerLink:
        return self.daemon if role is DAEMON else self.worker

    def peer(self, role: object) -> WorkerLink:
        return self.worker if role is DAEMON else self.daemon

    def send(self, role: object, events: Event | list[Event], expect: Any = "match") -> bytes:
        if not isinstance(events, list):
            events = [events]
        data = b"".join(self.link(role).send(e) for e in events)
        got = receive_and_get(self.peer(role), data)
        assert got == (events if expect == "match" else expect)
        assert self.daemon.state is self.worker.state
        return data

    def handshake(self) -> None:
        self.send(DAEMON, Hello())
        self.send(WORKER, hello_ack())
        assert self.daemon.state is READY


# ---- messages -----------------------------------------------------------------

MESSAGES = [
    Hello(),
    Hello(min_version=1, max_version=3),
    Tokenize(req=7, segments=[("<|im_start|>user\n", True), ("hi [[x]]", False)], add_special=True),
    admit(3),
    Admit(
        lane=0, tokens=[1, 2, 3, 40, 41], n_prompt=3, max_new=10, ignore_eos=True,
        sampling=Sampling(
            temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1, presence_penalty=0.5,
            frequency_penalty=-0.5, seed=2**32 - 1, logit_bias=[(5, -100.0), (6, 2.5)], n_logprobs=20,
            grammar='root ::= "yes"',
        ),
    ),
    admit(5, stops=("\n\n", "Q:")),
    tick(),
    tick(seq=9, prefill_lanes=(3, 1, 2)),
    Interrupt(),
    Cancel(lane=4),
    Cancel(lane=4, publish=False),
    Shutdown(),
    hello_ack(),
    hello_ack(model={"name": "m", "n_ctx": 4096, "eog": [2, 4]},
              capabilities={"logprobs": True, "grammar": "no grammar support", "input": {"image": "text only"}},
              limits={"max_lanes": 8}),
    LoadFailed(message="RuntimeError: no such file"),
    Tokenized(req=7, tokens=[]),
    Tokenized(req=7, tokens=[3, 1, 4, 1, 5]),
    Admitted(lane=3, cached=0),
    Admitted(lane=3, cached=511),
    Emit(items=[row(0), row(1, 2, b"", "eos"), [2, -1, b"", "cancelled", None],
                [3, 9, b"\xff\xfe", "length", [-0.25, [[9, b"\xff\xfe", -0.25], [10, b"x", -1.5]]]]]),
    TickDone(seq=9),
    TickDone(seq=9, rounds=3, prefill_tokens=512, decode_tokens=24, busy_ms=12.5, interrupted=True,
             prefill_left={3: 100, 7: 2}, kv_used=1000, kv_total=65536),
    Fault(),
    Fault(lane=2, kind="lane", message="sampler failed"),
    Telemetry(values={"kv_used": 10.0, "tok_s": 31.5}),
    Embed(req=3, inputs=[(1, 2), (3,)], normalize=False),
    Embedded(req=3, dim=1, vectors=[b"\0\0\x80?", b"\0\0\0\0"]),
    SlotAction(req=4, action="save", seq=1, filename="a.bin", cache_salt="p"),
    SlotAction(req=4, action="erase", seq=0),
    SlotDone(req=4, tokens=120, nbytes=4096),
    SlotDone(req=4, status=409, error="slot_foreign", message="another model"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trips(message: Event) -> None:
    assert from_wire(to_wire(message), max_len=DEFAULT_MAX_FRAME) == message


def test_every_message_type_has_a_round_trip_example() -> None:
    assert {type(m) for m in MESSAGES} == set(Event.__subclasses__())


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (Admit, {"lane": -1, "tokens": [1], "n_prompt": 1, "max_new": 1}),
        (Admit, {"lane": 0, "tokens": [], "n_prompt": 0, "max_new": 1}),
        (Admit, {"lane": 0, "tokens": [1, 2], "n_prompt": 3, "max_new": 1}),
        (Admit, {"lane": 0, "tokens": [1, True], "n_prompt": 1, "max_new": 1}),
        (Tokenized, {"req": 0, "tokens": [-1]}),
        (Admitted, {"lane": 0, "cached": 1.5}),
        (Emit, {"items": [[0, 1, b"x", None]]}),
        (Emit, {"items": [[0, 1, "x", None, None]]}),
        (Emit, {"items": [[0, -2, b"x", None, None]]}),
        (Emit, {"items": [[0, 1, b"x", "done", None]]}),
        (Tick, {"seq": 0, "prefill_budget": -1, "max_rounds": 0, "time_budget_ms": 0}),
        (Sampling, {"temperature": -0.5}),
        (Sampling, {"n_logprobs": 21}),
    ],
)
def test_messages_validate_in_the_constructor(cls: type, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        cls(**kw)


def test_messages_are_frozen_values() -> None:
    m = admit(1)
    assert m == admit(1) and hash(m) == hash(admit(1))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        m.lane = 2  # type: ignore[misc]


# ---- a whole conversation -----------------------------------------------------


def test_link_conversation() -> None:
    p = LinkPair()
    assert p.daemon.state is p.worker.state is IDLE
    p.send(DAEMON, Hello())
    assert p.daemon.state is HELLO_SENT
    # telemetry may flow while the model loads
    p.send(WORKER, Telemetry(values={"load_progress": 0.5}))
    p.send(WORKER, hello_ack(limits={"max_lanes": 4}))
    assert p.daemon.state is READY

    p.send(DAEMON, Tokenize(req=1, segments=[("hello", False)]))
    assert p.worker.statistics().pending_tokenize == 1
    p.send(WORKER, Tokenized(req=1, tokens=[1, 2, 3]))
    assert p.daemon.statistics().pending_tokenize == 0

    p.send(DAEMON, [admit(0), admit(1, (1, 2, 3, 4))])
    p.send(WORKER, [Admitted(lane=0, cached=0), Admitted(lane=1, cached=3)])
    assert p.daemon.statistics().open_lanes == p.worker.statistics().open_lanes == 2

    p.send(DAEMON, tick(seq=1))
    assert p.daemon.statistics().tick_running and p.worker.statistics().tick_running
    p.send(WORKER, [Emit(items=[row(0), row(1)]), Emit(items=[row(0, 2, b"", "eos"), row(1)])])
    assert p.daemon.statistics().open_lanes == 1  # a finish row closes its lane
    # an Interrupt ends the tick early; a Cancel retires a lane
    p.send(DAEMON, [Interrupt(), Cancel(lane=1)])
    p.send(WORKER, TickDone(seq=1, rounds=2, decode_tokens=4, interrupted=True))
    assert not p.daemon.statistics().tick_running
    p.send(WORKER, Emit(items=[[1, -1, b"", "cancelled", None]]))
    assert p.daemon.statistics().open_lanes == p.worker.statistics().open_lanes == 0

    # a lane number is reusable once its lane has finished
    p.send(DAEMON, [admit(0), tick(seq=2)])
    p.send(WORKER, [Fault(lane=0, kind="lane", message="boom"), TickDone(seq=2)])
    assert p.daemon.statistics().open_lanes == 0

    p.send(DAEMON, admit(5))
    p.send(DAEMON, Shutdown())
    assert p.daemon.state is CLOSING
    # the worker may still report what it finishes while closing
    p.send(WORKER, [Admitted(lane=5, cached=0), Emit(items=[row(5, 1, b"a", "length")]), Telemetry()])
    with pytest.raises(LocalProtocolError):
        p.daemon.send(admit(6))

    stats = p.daemon.statistics()
    assert stats.frames_out == 11 and stats.frames_in == 14
    assert stats.bytes_out == p.worker.statistics().bytes_in
    assert stats.bytes_in == p.worker.statistics().bytes_out


def test_link_load_failed_closes_the_link() -> None:
    p = LinkPair()
    p.send(DAEMON, Hello())
    p.send(WORKER, LoadFailed(message="no model"))
    assert p.daemon.state is p.worker.state is CLOSED
    # the worker exits: EOF in CLOSED is the orderly end
    p.daemon.receive_data(b"")
    assert p.daemon.next_event() is NEED_DATA


def test_link_shutdown_during_handshake() -> None:
    p = LinkPair()
    p.send(DAEMON, Hello())
    p.send(DAEMON, Shutdown())
    assert p.daemon.state is p.worker.state is CLOSING


def test_link_eof_after_shutdown_is_a_clean_close() -> None:
    # After Shutdown the worker is *expected* to exit; its EOF is not a violation.
    # (Neither side can reach CLOSED from CLOSING today: see the report.)
    p = LinkPair()
    p.handshake()
    p.send(DAEMON, Shutdown())
    for link in (p.daemon, p.worker):
        link.receive_data(b"")
        assert link.next_event() is NEED_DATA


# ---- our own mistakes: LocalProtocolError -----------------------------------------


def assert_refused(link: WorkerLink, event: Event) -> None:
    """``link.send(event)`` raises LocalProtocolError and leaves no half-applied send."""
    before = link.statistics()
    with pytest.raises(LocalProtocolError):
        link.send(event)
    after = link.statistics()
    assert (after.frames_out, after.bytes_out) == (before.frames_out, before.bytes_out)
    assert link.state is ERROR or conversation_state(after) == conversation_state(before)


DAEMON_MESSAGES = [Tokenize(req=1, segments=[]), admit(0), tick(), Interrupt(), Cancel(lane=0), Shutdown()]
WORKER_MESSAGES = [
    hello_ack(), LoadFailed(message="x"), Tokenized(req=1, tokens=[]), Admitted(lane=0, cached=0),
    Emit(items=[row(0)]), TickDone(seq=1), Fault(), Telemetry(),
]


@pytest.mark.parametrize("event", DAEMON_MESSAGES, ids=lambda m: type(m).__name__)
def test_daemon_may_send_nothing_before_hello(event: Event) -> None:
    assert_refused(WorkerLink(DAEMON), event)


@pytest.mark.parametrize("event", WORKER_MESSAGES, ids=lambda m: type(m).__name__)
def test_worker_may_send_nothing_before_hello(event: Event) -> None:
    assert_refused(WorkerLink(WORKER), event)


def test_roles_may_not_send_each_others_messages() -> None:
    p = LinkPair()
    p.handshake()
    for event in WORKER_MESSAGES:
        assert_refused(p.daemon, event)
    for event in DAEMON_MESSAGES + [Hello()]:
        assert_refused(p.worker, event)


def test_local_tick_beyond_the_pipeline_depth() -> None:
    # one tick runs and one may queue behind it (MAX_TICKS_IN_FLIGHT == 2); a third is refused
    p = LinkPair()
    p.handshake()
    p.send(DAEMON, tick(seq=1))
    p.send(DAEMON, tick(seq=2))
    assert_refused(p.daemon, tick(seq=3))
    p.send(WORKER, TickDone(seq=1))
    p.send(DAEMON, tick(seq=3))
    p.send(WORKER, TickDone(seq=2))
    p.send(WORKER, TickDone(seq=3))
    assert_refused(p.worker, TickDone(seq=4))


def test_local_admit_of_an_open_lane() -> None:
    p = LinkPair()
    p.handshake()
    p.send(DAEMON, admit(3))
    assert_refused(p.daemon, admit(3))
    # a cancelled lane stays open until the worker confirms the finish
    p.send(DAEMON, Cancel(lane=3))
    assert_refused(p.daemon, admit(3))
    p.send(WORKER, Emit(items=[[3, -1, b"", "cancelled", None]]))
    p.send(DAEMON, admit(3))


def test_local_worker_checks_its_own_lanes_and_ticks() -> None:
    p = LinkPair()
    p.handshake()
    assert_refused(p.worker, Emit(items=[row(0)]))
    assert_refused(p.worker, Admitted(lane=0, cached=0))
    assert_refused(p.worker, Fault(lane=0))
    assert_refused(p.worker, TickDone(seq=1))
    assert_refused(p.worker, Tokenized(req=1, tokens=[]))
    p.send(DAEMON, Tokenize(req=1, segments=[]))
    assert_refused(p.daemon, Tokenize(req=1, segments=[]))  # one pending request per id


def test_local_oversized_send_leaves_no_trace() -> None:
    # encode_frame refuses the frame *after* _apply() opened the lane, so the
    # link believes lane 1 is open although nothing was sent (see the report).
    link = WorkerLink(DAEMON, max_frame_size=256)
    peer = WorkerLink(WORKER, max_frame_size=256)
    assert receive_and_get(peer, link.send(Hello())) == [Hello()]
    assert receive_and_get(link, peer.send(hello_ack())) == [hello_ack()]
    assert_refused(link, admit(1, tuple(range(1000))))
    assert_refused(link, tick(prefill_lanes=tuple(range(1000))))
    if link.state is not ERROR:
        link.send(admit(1))  # the lane was never opened
        link.send(tick())


def test_send_failed_moves_to_error() -> None:
    p = LinkPair()
    p.handshake()
    p.daemon.send_failed()
    assert p.daemon.state is ERROR
    with pytest.raises(LocalProtocolError):
        p.daemon.send(tick())
    with pytest.raises(RemoteProtocolError):
        p.daemon.next_event()


# ---- the peer's mistakes: RemoteProtocolError -------------------------------------


def ready_daemon(*, lanes: tuple[int, ...] = (), tick_running: bool = False, **kw: Any) -> WorkerLink:
    """A DAEMON link in READY with ``lanes`` open (and optionally a tick running)."""
    link = WorkerLink(DAEMON, **kw)
    link.send(Hello())
    assert receive_and_get(link, encode_frame(to_wire(hello_ack()))) == [hello_ack()]
    for lane in lanes:
        link.send(admit(lane))
    if tick_running:
        link.send(tick())
    return link


def assert_remote_error(link: WorkerLink, data: bytes, *, eof: bool = False) -> None:
    with pytest.raises(RemoteProtocolError):
        link.receive_data(data)
        if eof:
            link.receive_data(b"")
        get_all_events(link)
    assert link.state is ERROR
    # ERROR is for good: nothing more comes out, and nothing more goes in
    with pytest.raises(RemoteProtocolError):
        link.next_event()
    with pytest.raises(LocalProtocolError):
        link.send(Cancel(lane=0))
    assert link.state is ERROR


def test_remote_emit_for_a_never_admitted_lane() -> None:
    link = ready_daemon(lanes=(0,), tick_running=True)
    assert_remote_error(link, encode_frame(to_wire(Emit(items=[row(0), row(1)]))))


def test_remote_emit_after_the_lane_finished() -> None:
    link = ready_daemon(lanes=(0,), tick_running=True)
    assert receive_and_get(link, encode_frame(to_wire(Emit(items=[row(0, finish="length")])))) != []
    assert_remote_error(link, encode_frame(to_wire(Emit(items=[row(0)]))))


def test_remote_tickdone_without_a_tick() -> None:
    assert_remote_error(ready_daemon(), encode_frame(to_wire(TickDone(seq=1))))


def test_remote_message_forbidden_by_the_table() -> None:
    assert_remote_error(ready_daemon(), encode_frame(to_wire(hello_ack())))  # a second HelloAck
    assert_remote_error(ready_daemon(), encode_frame(to_wire(Admit(lane=0, tokens=[1], n_prompt=1, max_new=1))))


def test_remote_unknown_required_message() -> None:
    assert_remote_error(ready_daemon(), frame(0x70, {}))
    assert_remote_error(ready_daemon(), frame(-1, {}))


def test_remote_oversized_frame_is_refused_before_its_body() -> None:
    link = ready_daemon(max_frame_size=1024)
    # the header alone is enough: no byte of the body ever arrives
    assert_remote_error(link, struct.pack(">I", 1025))
    link = ready_daemon(max_frame_size=1024)
    assert_remote_error(link, b"\xff\xff\xff\xff")


def telemetry_body_of_size(size: int) -> bytes:
    for n in range(size):
        body = to_wire(Telemetry(values={"x" * n: 1.0}))
        if len(body) == size:
            return body
    raise AssertionError(f"no Telemetry body of {size} bytes")


def test_frame_of_exactly_max_size_is_accepted() -> None:
    body = telemetry_body_of_size(1024)
    link = ready_daemon(max_frame_size=1024)
    assert receive_and_get(link, encode_frame(body, max_frame_size=1024)) == [from_wire(body, max_len=1024)]
    with pytest.raises(LocalProtocolError):
        encode_frame(body + b"\x00", max_frame_size=1024)
    assert_remote_error(ready_daemon(max_frame_size=1023), encode_frame(body))


def test_remote_eof_inside_a_frame() -> None:
    data = encode_frame(to_wire(Admitted(lane=0, cached=0)))
    for cut in (1, 3, 4, 5, len(data) - 1):
        assert_remote_error(ready_daemon(lanes=(0,)), data[:cut], eof=True)


def test_remote_eof_between_frames_before_shutdown() -> None:
    assert_remote_error(ready_daemon(), b"", eof=True)
    link = WorkerLink(WORKER)
    assert_remote_error(link, b"", eof=True)


def test_remote_data_after_eof() -> None:
    link = ready_daemon()
    link.receive_data(b"")
    with pytest.raises(RemoteProtocolError):
        link.receive_data(b"\x00")
    assert link.state is ERROR


BAD_BODIES = {
    "not msgpack": b"\xc1",
    "trailing bytes": msgpack.packb([Admitted.code, {"lane": 0, "cached": 0}]) + b"\x00",
    "not an array": msgpack.packb({"code": Admitted.code}),
    "array of three": msgpack.packb([Admitted.code, {}, 1]),
    "code not an int": msgpack.packb(["Admitted", {"lane": 0, "cached": 0}]),
    "fields not a map": msgpack.packb([Admitted.code, [0, 0]]),
    "missing field": msgpack.packb([Admitted.code, {"lane": 0}]),
    "unknown field": msgpack.packb([Admitted.code, {"lane": 0, "cached": 0, "extra": 1}]),
    "non-str field name": msgpack.packb([Admitted.code, {"lane": 0, "cached": 0, 1: 2}]),
    "ext type": msgpack.packb([Admitted.code, {"lane": msgpack.ExtType(1, b"x"), "cached": 0}]),
}

WRONG_TYPES = {
    "Admitted.lane str": (Admitted, {"lane": "0", "cached": 0}),
    "Admitted.cached negative": (Admitted, {"lane": 0, "cached": -1}),
    "Admitted.cached bool": (Admitted, {"lane": 0, "cached": True}),
    "Tokenized.tokens str": (Tokenized, {"req": 1, "tokens": "abc"}),
    "Tokenized.tokens map": (Tokenized, {"req": 1, "tokens": {"a": 1}}),
    "Emit.items int": (Emit, {"items": 5}),
    "Emit.row str piece": (Emit, {"items": [[0, 1, "text", None, None]]}),
    "Emit.row short": (Emit, {"items": [[0, 1, b"x"]]}),
    "Emit.row list finish": (Emit, {"items": [[0, 1, b"x", ["eos"], None]]}),
    "TickDone.seq str": (TickDone, {"seq": "1"}),
    "TickDone.prefill_left list": (TickDone, {"seq": 1, "prefill_left": [1, 2]}),
    "TickDone.rounds str": (TickDone, {"seq": 1, "rounds": "many"}),
    "TickDone.busy_ms str": (TickDone, {"seq": 1, "busy_ms": "fast"}),
    "TickDone.kv_used None": (TickDone, {"seq": 1, "kv_used": None}),
    "Fault.lane str": (Fault, {"lane": "0"}),
    "Fault.lane None": (Fault, {"lane": None}),
    "Fault.message int": (Fault, {"lane": -1, "message": 5}),
    "Telemetry.values list": (Telemetry, {"values": [1.0]}),
}


@pytest.mark.parametrize("body", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
def test_remote_malformed_body(body: bytes) -> None:
    assert_remote_error(ready_daemon(lanes=(0,), tick_running=True), encode_frame(body))


@pytest.mark.parametrize(("cls", "fields"), list(WRONG_TYPES.values()), ids=list(WRONG_TYPES))
def test_remote_wrong_field_types(cls: type[Event], fields: dict[str, Any]) -> None:
    # SPEC.md §3: "a field of the wrong type ... is a RemoteProtocolError"
    assert_remote_error(ready_daemon(lanes=(0,), tick_running=True), frame(cls.code, fields))


@pytest.mark.parametrize(
    "fields",
    [
        {"version": 1, "runtime": 5, "runtime_version": "0"},
        {"version": 1, "runtime": "mock", "runtime_version": ["0"]},
        {"version": 1, "runtime": "mock", "runtime_version": "0", "limits": [8]},
        {"version": "1", "runtime": "mock", "runtime_version": "0"},
    ],
)
def test_remote_wrong_field_types_in_hello_ack(fields: dict[str, Any]) -> None:
    link = WorkerLink(DAEMON)
    link.send(Hello())
    assert_remote_error(link, frame(HelloAck.code, fields))


@pytest.mark.parametrize(
    "fields", [{"min_version": "1", "max_version": 1}, {"min_version": 1, "max_version": None}]
)
def test_remote_wrong_field_types_in_hello(fields: dict[str, Any]) -> None:
    assert_remote_error(WorkerLink(WORKER), frame(Hello.code, fields))


# ---- droppable messages -------------------------------------------------------------


def test_unknown_droppable_messages_are_skipped_and_counted() -> None:
    link = ready_daemon(lanes=(0,))
    data = (
        frame(0x80, {})
        + frame(0xFF, {"anything": [1, 2, {"x": b"y"}]})
        + encode_frame(to_wire(Admitted(lane=0, cached=0)))
        + frame(0x9A, {})
    )
    assert receive_and_get(link, data) == [Admitted(lane=0, cached=0)]
    stats = link.statistics()
    assert stats.dropped == 3
    assert stats.frames_in == 4 + 1  # and the HelloAck
    assert link.state is READY


def test_droppable_messages_are_skipped_in_any_live_state() -> None:
    link = WorkerLink(DAEMON)
    link.send(Hello())
    assert receive_and_get(link, frame(0x90, {})) == []
    assert link.state is HELLO_SENT and link.statistics().dropped == 1


def test_known_telemetry_is_delivered_not_dropped() -> None:
    link = ready_daemon()
    assert receive_and_get(link, encode_frame(to_wire(Telemetry(values={"a": 1.0})))) == [
        Telemetry(values={"a": 1.0})
    ]
    assert link.statistics().dropped == 0


# ---- chunking does not matter ----------------------------------------------------------

DAEMON_STREAM = [
    Hello(),
    Tokenize(req=1, segments=[("hi", False)]),
    admit(0),
    admit(1, tuple(range(300))),
    tick(),
    Interrupt(),
    Cancel(lane=1),
    Shutdown(),
]


def daemon_bytes() -> bytes:
    """What a daemon sends for ``DAEMON_STREAM``, with a droppable frame after the Hello."""
    link = WorkerLink(DAEMON)
    out = link.send(Hello()) + frame(0x85, {"x": 1})
    assert receive_and_get(link, encode_frame(to_wire(hello_ack()))) == [hello_ack()]
    return out + b"".join(link.send(e) for e in DAEMON_STREAM[1:])


def worker_receives(data: bytes, cuts: list[int]) -> tuple[list[Event], WorkerLink]:
    """Feed ``data`` to a WORKER link split at ``cuts``, answering the Hello."""
    link = WorkerLink(WORKER)
    got: list[Event] = []
    start = 0
    for end in [*sorted(set(cuts)), len(data)]:
        if end > start:  # b"" would mean EOF
            link.receive_data(data[start:end])
            start = end
        while (event := link.next_event()) is not NEED_DATA:
            got.append(event)
            if isinstance(event, Hello):
                link.send(hello_ack())
    return got, link


def test_byte_at_a_time_yields_the_same_events() -> None:
    data = daemon_bytes()
    whole, _ = worker_receives(data, [])
    assert whole == DAEMON_STREAM
    by_byte, link = worker_receives(data, list(range(len(data))))
    assert by_byte == whole
    assert link.statistics().dropped == 1
    assert link.state is CLOSING


@HYPOTHESIS
@given(st.data())
def test_any_chunking_yields_the_same_events(data: st.DataObject) -> None:
    stream = daemon_bytes()
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=30))
    assert worker_receives(stream, cuts)[0] == DAEMON_STREAM


def test_byte_at_a_time_finds_errors_at_the_same_frame() -> None:
    good = encode_frame(to_wire(Admitted(lane=0, cached=0)))
    bad = encode_frame(to_wire(Emit(items=[row(9)])))
    for feed in ("whole", "bytes"):
        link = ready_daemon(lanes=(0,))
        got: list[Event] = []
        with pytest.raises(RemoteProtocolError):
            for b in [good + bad] if feed == "whole" else [bytes([x]) for x in good + bad]:
                link.receive_data(b)
                while (event := link.next_event()) is not NEED_DATA:
                    got.append(event)
        assert got == [Admitted(lane=0, cached=0)]


# ---- SPEC.md mirrors the table -------------------------------------------------------

TABLE_HEADER = ("state", "sender", "message", "next state")


def render_transition_table() -> str:
    """``TRANSITIONS`` as the Markdown table that belongs under ``### Link transitions``."""
    rows = sorted(
        TRANSITIONS.items(),
        key=lambda kv: (STATE_ORDER.index(kv[0][0]), repr(kv[0][1]), kv[0][2].code),
    )
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|---|---|---|---|"]
    for (state, sender, cls), new_state in rows:
        lines.append(f"| {state!r} | {sender!r} | {cls.__name__} | {new_state!r} |")
    return "\n".join(lines) + "\n"


def parse_transition_table(text: str) -> list[tuple[str, str, str, str]]:
    """The rows of the first Markdown table under ``### Link transitions``."""
    lines = text.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "### Link transitions")
    except StopIteration:
        raise AssertionError("SPEC.md has no '### Link transitions' heading") from None
    table: list[list[str]] = []
    for ln in lines[start + 1 :]:
        if ln.startswith("#"):
            break
        if ln.strip().startswith("|"):
            table.append([c.strip().strip("`") for c in ln.strip().strip("|").split("|")])
        elif table:
            break
    assert table, "no table under '### Link transitions'"
    header, rule, *body = table
    assert tuple(c.lower() for c in header) == TABLE_HEADER
    assert all(re.fullmatch(r":?-+:?", c) for c in rule)
    assert all(len(r) == 4 for r in body)
    return [(r[0], r[1], r[2], r[3]) for r in body]


def test_render_transition_table_round_trips() -> None:
    rows = parse_transition_table("### Link transitions\n\n" + render_transition_table())
    assert len(rows) == len(TRANSITIONS)


def test_spec_transition_table_matches_the_code() -> None:
    assert SPEC.exists(), "SPEC.md is missing"
    rows = parse_transition_table(SPEC.read_text(encoding="utf-8"))
    assert len(rows) == len(set(rows)), "SPEC.md lists a transition twice"
    code = {(repr(s), repr(who), cls.__name__, repr(new)) for (s, who, cls), new in TRANSITIONS.items()}
    spec = set(rows)
    assert spec == code, (
        f"only in SPEC.md: {sorted(spec - code)}; only in the code: {sorted(code - spec)}\n"
        f"expected table:\n{render_transition_table()}"
    )


# ---- SSE and NDJSON ---------------------------------------------------------------------


def test_sse_single_line() -> None:
    assert encode_sse(data="hello") == b"data: hello\n\n"


def test_sse_multi_line_data_is_one_field_per_line() -> None:
    assert encode_sse(data="a\nb\r\nc\rd") == b"data: a\ndata: b\ndata: c\ndata: d\n\n"
    assert encode_sse(data="a\n") == b"data: a\ndata: \n\n"
    assert encode_sse(data="") == b"data: \n\n"
    assert encode_sse(data=" lead") == b"data:  lead\n\n"  # the client strips exactly one space


def test_sse_fields() -> None:
    assert encode_sse(data="x", event="delta", id="17", retry=3000) == (
        b"event: delta\nid: 17\nretry: 3000\ndata: x\n\n"
    )
    assert encode_sse(data="x", id="") == b"id: \ndata: x\n\n"


def test_sse_unicode_is_utf8() -> None:
    assert encode_sse(data="héllo ☃", event="é") == "event: é\ndata: héllo ☃\n\n".encode()


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\r\nb", "\n", "\r"])
def test_sse_rejects_cr_lf_in_id_and_event(bad: str) -> None:
    with pytest.raises(ValueError):
        encode_sse(data="x", id=bad)
    with pytest.raises(ValueError):
        encode_sse(data="x", event=bad)


def test_sse_constants_and_json() -> None:
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert SSE_PING == b": ping\n\n"
    assert encode_sse_json({"a": [1, "é\n"]}) == 'data: {"a":[1,"é\\n"]}\n\n'.encode()
    assert encode_sse_json({}, event="error", id="3") == b"event: error\nid: 3\ndata: {}\n\n"
    assert encode_ndjson({"a": "é"}) == '{"a":"é"}\n'.encode()


@settings(database=None, max_examples=200)
@given(st.text())
def test_sse_data_parses_back(text: str) -> None:
    # a WHATWG parser: lines split on CR, LF or CRLF, "data: " prefix, joined by LF
    out = encode_sse(data=text).decode()
    assert out.endswith("\n\n")
    lines = out[:-2].split("\n")
    assert all(ln.startswith("data: ") for ln in lines)
    expected = text.replace("\r\n", "\n").replace("\r", "\n")
    assert "\n".join(ln[len("data: ") :] for ln in lines) == expected
