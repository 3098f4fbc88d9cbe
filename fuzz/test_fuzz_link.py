"""Fuzz the worker link (after h11's fuzz harness).

Invariant: whatever bytes the peer sends, ``WorkerLink`` yields well-typed
events or raises ``RemoteProtocolError`` -- nothing else -- and it does the
same whether the bytes arrive whole or one at a time.

Budget: ``SUPERFLUID_FUZZ_EXAMPLES`` examples per test (default 200).
"""

from __future__ import annotations

import os
import types
import typing
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from superfluid.proto import (
    DAEMON,
    NEED_DATA,
    PROTOCOL_VERSION,
    WORKER,
    Admit,
    Admitted,
    Cancel,
    Emit,
    Event,
    Fault,
    Hello,
    HelloAck,
    Interrupt,
    LoadFailed,
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
    to_wire,
)
from superfluid.proto._state import ERROR

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("SUPERFLUID_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_FRAME = 4096  # small, so random length prefixes sometimes fit

# ---- the links under test ----------------------------------------------------------------


def hello_ack() -> HelloAck:
    return HelloAck(version=PROTOCOL_VERSION, runtime="mock", runtime_version="0")


def daemon_link(stage: str) -> WorkerLink:
    """A DAEMON link that has sent Hello; with ``stage="ready"`` it has also been
    acknowledged, opened lanes 0 and 1, asked to tokenize request 1 and started a tick."""
    link = WorkerLink(DAEMON, max_frame_size=MAX_FRAME)
    link.send(Hello())
    if stage == "ready":
        link.receive_data(encode_frame(to_wire(hello_ack())))
        assert link.next_event() == hello_ack()
        link.send(Tokenize(req=1, segments=[("hi", False)]))
        link.send(Admit(lane=0, tokens=[1, 2], n_prompt=2, max_new=4))
        link.send(Admit(lane=1, tokens=[1, 2], n_prompt=2, max_new=4))
        link.send(Tick(seq=1, prefill_budget=64, max_rounds=4, time_budget_ms=50))
    return link


def worker_link(stage: str) -> WorkerLink:
    """A WORKER link; with ``stage="ready"`` it has received Hello and answered."""
    link = WorkerLink(WORKER, max_frame_size=MAX_FRAME)
    if stage == "ready":
        link.receive_data(encode_frame(to_wire(Hello())))
        assert link.next_event() == Hello()
        link.send(hello_ack())
    return link


LINKS = {
    "daemon-hello": lambda: daemon_link("hello"),
    "daemon-ready": lambda: daemon_link("ready"),
    "worker-idle": lambda: worker_link("idle"),
    "worker-ready": lambda: worker_link("ready"),
}


# ---- the invariant ------------------------------------------------------------------------


def _well_typed(value: Any, tp: Any, where: str) -> None:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return
    if origin is typing.Union or origin is types.UnionType:
        for alt in args:
            try:
                _well_typed(value, alt, where)
                return
            except AssertionError:
                pass
        raise AssertionError(f"{where} = {value!r} is none of {args}")
    if tp is type(None):
        assert value is None, f"{where} = {value!r} is not None"
    elif tp is bool:
        assert isinstance(value, bool), f"{where} = {value!r} is not a bool"
    elif tp is int:
        assert isinstance(value, int) and not isinstance(value, bool), f"{where} = {value!r} is not an int"
    elif tp is float:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{where} = {value!r} is not a number"
    elif tp in (str, bytes):
        assert isinstance(value, tp), f"{where} = {value!r} is not {tp.__name__}"
    elif origin is tuple:
        assert isinstance(value, tuple), f"{where} = {value!r} is not a tuple"
        if len(args) == 2 and args[1] is Ellipsis:
            for i, item in enumerate(value):
                _well_typed(item, args[0], f"{where}[{i}]")
        else:
            assert len(value) == len(args), f"{where} = {value!r} has the wrong length"
            for i, (item, arg) in enumerate(zip(value, args, strict=True)):
                _well_typed(item, arg, f"{where}[{i}]")
    elif origin is dict:
        assert isinstance(value, dict), f"{where} = {value!r} is not a map"
        for k, v in value.items():
            _well_typed(k, args[0], f"{where} key")
            _well_typed(v, args[1], f"{where}[{k!r}]")
    elif attrs.has(tp):
        assert isinstance(value, tp), f"{where} = {value!r} is not a {tp.__name__}"
        check_well_typed(value)
    else:  # pragma: no cover - a new annotation form; teach the checker
        raise AssertionError(f"{where}: cannot check annotation {tp!r}")


def check_well_typed(value: Any) -> None:
    """Every field holds what its annotation says (SPEC.md §3: a wrong type is a protocol error)."""
    cls = type(value)
    attrs.resolve_types(cls)
    for field in attrs.fields(cls):
        _well_typed(getattr(value, field.name), field.type, f"{cls.__name__}.{field.name}")


def feed(link: WorkerLink, chunks: list[bytes], eof: bool) -> tuple[list[Event], bool]:
    """Feed ``chunks``; the events that came out, and whether the peer was blamed."""
    events: list[Event] = []
    try:
        for chunk in [*chunks, b""] if eof else chunks:
            link.receive_data(chunk)
            while (event := link.next_event()) is not NEED_DATA:
                assert isinstance(event, Event)
                events.append(event)
    except RemoteProtocolError:
        assert link.state is ERROR
        with pytest.raises(RemoteProtocolError):
            link.next_event()
        return events, True
    assert link.state is not ERROR
    return events, False


def check(make_link: str, data: bytes, eof: bool, *, typed: bool = False) -> None:
    events, blamed = feed(LINKS[make_link](), [data] if data else [], eof)
    events_by_byte, blamed_by_byte = feed(LINKS[make_link](), [data[i : i + 1] for i in range(len(data))], eof)
    # compared on the wire: a NaN field is never == itself
    assert [to_wire(e) for e in events] == [to_wire(e) for e in events_by_byte]
    assert blamed == blamed_by_byte
    if typed:
        for event in events:
            check_well_typed(event)


# ---- unstructured: arbitrary bytes --------------------------------------------------------

link_names = st.sampled_from(sorted(LINKS))


def framed(bodies: list[bytes]) -> bytes:
    return b"".join(len(b).to_bytes(4, "big") + b for b in bodies)


raw_streams = st.one_of(
    st.binary(max_size=512),
    st.lists(st.binary(max_size=64), max_size=8).map(framed),  # plausible lengths, junk bodies
    st.tuples(st.lists(st.binary(max_size=64), max_size=4).map(framed), st.binary(max_size=16)).map(b"".join),
)


@FUZZ
@given(make_link=link_names, data=raw_streams, eof=st.booleans())
@example(make_link="daemon-ready", data=b"\xff\xff\xff\xff garbage", eof=False)  # the mock's garbage_after
@example(make_link="daemon-ready", data=b"\x00\x00\x00\x02\x92", eof=True)
def test_fuzz_arbitrary_bytes(make_link: str, data: bytes, eof: bool) -> None:
    check(make_link, data, eof)


# ---- structured: valid frames with mutated msgpack payloads --------------------------------

msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(msgpack_scalars.filter(lambda k: k is not None and not isinstance(k, float)), inner, max_size=4),
    max_leaves=12,
)

WORKER_SEEDS: list[Event] = [
    hello_ack(),
    HelloAck(version=1, runtime="mock", runtime_version="0", model={"n": 1}, capabilities={"x": True},
             limits={"max_lanes": 4}),
    LoadFailed(message="no"),
    Tokenized(req=1, tokens=[1, 2]),
    Admitted(lane=0, cached=0),
    Emit(items=[[0, 7, b"x", None, None], [1, 2, b"", "eos", None]]),
    Emit(items=[[1, 9, b"y", "length", [-0.5, [[9, b"y", -0.5]]]]]),
    TickDone(seq=1, rounds=1, prefill_tokens=2, decode_tokens=2, busy_ms=1.5, prefill_left={0: 1}),
    Fault(lane=0, kind="lane", message="m"),
    Fault(),
    Telemetry(values={"a": 1.0}),
]
DAEMON_SEEDS: list[Event] = [
    Hello(),
    Tokenize(req=1, segments=[("a", False), ("<s>", True)], add_special=True),
    Admit(lane=0, tokens=[1, 2, 3], n_prompt=2, max_new=5, sampling=Sampling(temperature=0.5, seed=3)),
    Tick(seq=1, prefill_budget=8, max_rounds=2, time_budget_ms=5, prefill_lanes=[0]),
    Interrupt(),
    Cancel(lane=0),
    Shutdown(),
]


def decoded(event: Event) -> tuple[int, dict[Any, Any]]:
    code, fields = msgpack.unpackb(to_wire(event), raw=False, strict_map_key=False)
    return code, fields


@st.composite
def mutated_frame(draw: st.DrawFn, seeds: list[Event]) -> bytes:
    code, fields = decoded(draw(st.sampled_from(seeds)))
    fields = dict(fields)
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["replace", "replace", "delete", "add", "nest", "code"]))
        if action == "replace" and fields:
            fields[draw(st.sampled_from(sorted(fields)))] = draw(msgpack_values)
        elif action == "delete" and fields:
            del fields[draw(st.sampled_from(sorted(fields)))]
        elif action == "add":
            fields[draw(st.text(max_size=8))] = draw(msgpack_values)
        elif action == "nest" and fields:
            # mutate one level down: a row of an Emit, an entry of a map, ...
            key = draw(st.sampled_from(sorted(fields)))
            value = fields[key]
            if isinstance(value, list) and value:
                i = draw(st.integers(0, len(value) - 1))
                item = value[i]
                if isinstance(item, list) and item:
                    item = list(item)
                    item[draw(st.integers(0, len(item) - 1))] = draw(msgpack_values)
                    value = [*value[:i], item, *value[i + 1 :]]
                else:
                    value = [*value[:i], draw(msgpack_values), *value[i + 1 :]]
            elif isinstance(value, dict) and value:
                value = {**value, draw(st.sampled_from(sorted(value, key=repr))): draw(msgpack_values)}
            fields[key] = value
        elif action == "code":
            code = draw(st.sampled_from([0x00, 0x0E, 0x10, 0x7F, 0x80, 0x82, 0xFF]) | st.integers(-5, 300))
    shape = draw(st.sampled_from(["ok", "ok", "ok", "ok", "list-fields", "triple", "scalar"]))
    obj: Any = {"ok": [code, fields], "list-fields": [code, list(fields.values())],
                "triple": [code, fields, None], "scalar": code}[shape]
    body = msgpack.packb(obj, use_bin_type=True)
    return encode_frame(body, max_frame_size=1 << 20)


def valid_frame(seeds: list[Event]) -> st.SearchStrategy[bytes]:
    return st.sampled_from(seeds).map(lambda e: encode_frame(to_wire(e)))


def conversations(seeds: list[Event]) -> st.SearchStrategy[bytes]:
    frames = st.one_of(valid_frame(seeds), mutated_frame(seeds))
    return st.lists(frames, min_size=1, max_size=6).map(b"".join)


@FUZZ
@given(make_link=st.sampled_from(["daemon-hello", "daemon-ready"]), data=conversations(WORKER_SEEDS),
       eof=st.booleans())
# found by this harness: WorkerLink._check_conversation compares ``Fault.lane >= 0``
# before anything checked that the lane is an int, so a TypeError escapes next_event()
@example(make_link="daemon-ready", data=encode_frame(msgpack.packb([Fault.code, {"lane": "0"}])), eof=False)
@example(make_link="daemon-ready", data=encode_frame(msgpack.packb([Fault.code, {"lane": None}])), eof=False)
def test_fuzz_mutated_worker_messages(make_link: str, data: bytes, eof: bool) -> None:
    check(make_link, data, eof)


@FUZZ
@given(make_link=st.sampled_from(["worker-idle", "worker-ready"]), data=conversations(DAEMON_SEEDS),
       eof=st.booleans())
def test_fuzz_mutated_daemon_messages(make_link: str, data: bytes, eof: bool) -> None:
    check(make_link, data, eof)


@FUZZ
@given(make_link=link_names, data=st.one_of(conversations(WORKER_SEEDS), conversations(DAEMON_SEEDS)))
@example(make_link="daemon-hello", data=encode_frame(
    msgpack.packb([HelloAck.code, {"version": 1, "runtime": None, "runtime_version": "0"}])))
@example(make_link="daemon-ready", data=encode_frame(msgpack.packb([TickDone.code, {"seq": 1, "prefill_left": [1]}])))
def test_fuzz_delivered_events_are_well_typed(make_link: str, data: bytes) -> None:
    # SPEC.md §3: "a field of the wrong type ... is a RemoteProtocolError", so
    # whatever is delivered holds what its annotations say.
    check(make_link, data, eof=False, typed=True)
