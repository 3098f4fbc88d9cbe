"""The session-log codec and scanner (pure, no I/O)."""

from __future__ import annotations

import array
import pickle
import re
from pathlib import Path

import msgpack
import pytest

from superfluid.proto import _wal
from superfluid.proto._errors import LocalProtocolError
from superfluid.proto._link import NEED_DATA
from superfluid.proto._wal import (
    HEADER_SIZE,
    MAGIC,
    WalCorrupt,
    WalEnd,
    WalReader,
    WalRecord,
    body_cancelled,
    body_created,
    body_epoch_bump,
    body_finished,
    body_generated,
    body_prompt,
    encode_record,
    ends_session,
    read_wal,
    validate_body,
    wal_checksum,
)


def rec(session: str, event_id: int, body: dict, *, epoch: int = 1, ts: int = 1_700_000_000_000) -> WalRecord:
    return WalRecord(session=session, event_id=event_id, epoch=epoch, ts=ts, body=body)


def sample_records() -> list[WalRecord]:
    return [
        rec("", 0, body_epoch_bump()),
        rec("s1", 0, body_created(params={"temperature": 0.0, "seed": 7, "stop": ("a", "b")}, klass="agent",
                                  model="mock")),
        rec("s1", 1, body_prompt(tokens=(1, 2, 3, 70000), text="héllo")),
        rec("s2", 0, body_created(params={}, klass="interactive", model="mock")),
        rec("s1", 2, body_generated(tokens=[4, 5], text="wor")),
        rec("s2", 1, body_prompt(tokens=array.array("I", [9, 9]))),
        rec("s1", 3, body_generated(tokens=[6], text="ld 🌍", finish="eos")),
        rec("s2", 2, body_cancelled()),
        rec("s3", 0, body_created(params={}, klass="agent", model="m")),
        rec("s3", 1, body_finished(finish="error", error={"status": 503, "message": "worker died"})),
    ]


def log_bytes(records: list[WalRecord]) -> bytes:
    return MAGIC + b"".join(encode_record(r) for r in records)


def boundaries(records: list[WalRecord]) -> list[int]:
    out = [len(MAGIC)]
    for r in records:
        out.append(out[-1] + len(encode_record(r)))
    return out


def test_wal_codec_round_trip() -> None:
    records = sample_records()
    got, end = read_wal(log_bytes(records))
    assert got == records
    assert end == WalEnd(offset=len(log_bytes(records)), size=len(log_bytes(records)), torn=False)
    assert end.clean


def test_wal_codec_header_layout() -> None:
    r = rec("s", 0, body_created(params={}, klass="agent", model="m"))
    data = encode_record(r)
    length, checksum = int.from_bytes(data[:4], "little"), int.from_bytes(data[4:12], "little")
    payload = data[HEADER_SIZE:]
    assert length == len(payload)
    assert checksum == wal_checksum(payload)
    assert msgpack.unpackb(payload) == {"session": "s", "event_id": 0, "epoch": 1, "ts": r.ts, "body": r.body}
    assert payload.startswith(b"\x85\xa7session")


def test_wal_codec_canonical_bodies() -> None:
    assert body_prompt(tokens=(1, 2)) == {"type": "prompt", "tokens": [1, 2], "text": None}
    assert body_generated(tokens=range(3), text="x") == {"type": "generated", "tokens": [0, 1, 2], "text": "x",
                                                         "finish": None}
    assert body_finished(finish="length") == {"type": "finished", "finish": "length", "error": None}
    assert validate_body({"type": "cancelled"}) == body_cancelled()
    assert body_created(params={"a": (1, {"b": (2,)})}, klass="k", model="m")["params"] == {"a": [1, {"b": [2]}]}
    assert ends_session(body_cancelled())
    assert ends_session(body_finished(finish="eos"))
    assert ends_session(body_generated(tokens=[1], text="", finish="length"))
    assert not ends_session(body_generated(tokens=[1], text=""))
    assert not ends_session(body_prompt(tokens=[1]))


@pytest.mark.parametrize(
    "body",
    [
        {"type": "nope"},
        {"tokens": [1]},
        {"type": "prompt"},
        {"type": "prompt", "tokens": [1, -1]},
        {"type": "prompt", "tokens": [1.0]},
        {"type": "prompt", "tokens": [2**32]},
        {"type": "prompt", "tokens": "abc"},
        {"type": "prompt", "tokens": [1], "extra": 1},
        {"type": "generated", "tokens": [1]},
        {"type": "generated", "tokens": [1], "text": b"x"},
        {"type": "generated", "tokens": [1], "text": "x", "finish": ""},
        {"type": "finished"},
        {"type": "finished", "finish": "eos", "error": 3},
        {"type": "created", "params": [], "klass": "a", "model": "m"},
        {"type": "created", "params": {1: 2}, "klass": "a", "model": "m"},
        {"type": "created", "params": {"x": object()}, "klass": "a", "model": "m"},
        {"type": "cancelled", "why": "x"},
    ],
)
def test_wal_codec_rejects_bad_bodies(body: dict) -> None:
    with pytest.raises(ValueError, match=r"type|tokens|text|finish|field|missing|params|error|map|msgpack"):
        validate_body(body)


def test_wal_codec_record_rules() -> None:
    with pytest.raises(ValueError, match="daemon session"):
        rec("", 0, body_cancelled())
    with pytest.raises(ValueError, match="daemon session"):
        rec("s", 0, body_epoch_bump())
    with pytest.raises(ValueError, match="event_id"):
        rec("s", -1, body_cancelled())
    with pytest.raises(ValueError, match="at most 256"):
        rec("x" * 300, 0, body_cancelled())
    with pytest.raises(LocalProtocolError, match="exceeds"):
        encode_record(rec("s", 0, body_prompt(tokens=list(range(100)))), max_record_size=64)


def feed_all(data: bytes, *, chunk: int | None = None) -> tuple[list[WalRecord], WalEnd]:
    reader = WalReader()
    records: list[WalRecord] = []
    pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    for piece in [*pieces, b""]:
        reader.receive_data(piece)
        while True:
            item = reader.next_record()
            if item is NEED_DATA:
                break
            if isinstance(item, WalEnd):
                assert reader.next_record() is item
                return records, item
            records.append(item)
    raise AssertionError("no end after EOF")


def test_wal_reader_byte_by_byte_matches_whole() -> None:
    data = log_bytes(sample_records())
    assert feed_all(data, chunk=1) == feed_all(data) == read_wal(data)


def test_wal_reader_needs_data_then_ends() -> None:
    data = log_bytes(sample_records()[:2])
    reader = WalReader()
    reader.receive_data(data[:-1])
    assert isinstance(reader.next_record(), WalRecord)
    assert reader.next_record() is NEED_DATA
    reader.receive_data(data[-1:])
    assert isinstance(reader.next_record(), WalRecord)
    assert reader.next_record() is NEED_DATA
    reader.receive_data(b"")
    assert reader.next_record() == WalEnd(offset=len(data), size=len(data), torn=False)
    with pytest.raises(LocalProtocolError):
        reader.receive_data(b"x")


def test_wal_reader_empty_and_magic_edge_cases() -> None:
    assert read_wal(b"") == ([], WalEnd(offset=0, size=0, torn=False))
    assert read_wal(MAGIC) == ([], WalEnd(offset=8, size=8, torn=False))
    assert read_wal(MAGIC[:5]) == ([], WalEnd(offset=0, size=5, torn=True, reason="the file ends inside its magic"))
    records, end = read_wal(b"\0" * 100)
    assert records == []
    assert end.torn
    assert end.offset == 0
    with pytest.raises(WalCorrupt, match="not a session log") as info:
        read_wal(b"BRTWAL02" + b"\0" * 20)
    assert info.value.offset == 0
    with pytest.raises(WalCorrupt, match="not a session log"):
        read_wal(b"xyz")


def test_wal_reader_torn_short_record() -> None:
    records = sample_records()
    data = log_bytes(records)
    cuts = boundaries(records)
    for cut in (cuts[-2] + 3, cuts[-2] + HEADER_SIZE + 1, len(data) - 1):
        got, end = read_wal(data[:cut])
        assert got == records[:-1]
        assert end.torn and end.offset == cuts[-2] and end.size == cut


def test_wal_reader_torn_bad_checksum_then_zeros() -> None:
    records = sample_records()
    data = bytearray(log_bytes(records))
    start = boundaries(records)[-2]
    # a torn write: the last record's payload only partly reached the disk
    data[start + HEADER_SIZE + 5 :] = b"\0" * (len(data) - start - HEADER_SIZE - 5)
    for tail in (b"", b"\0" * 4096):
        got, end = read_wal(bytes(data) + tail)
        assert got == records[:-1]
        assert end.torn and end.offset == start and "checksum" in end.reason


def test_wal_reader_zero_filled_tail_after_good_records() -> None:
    records = sample_records()
    data = log_bytes(records)
    for n in (1, 11, 12, 5000):
        got, end = read_wal(data + b"\0" * n)
        assert got == records
        assert end.torn and end.offset == len(data) and end.size == len(data) + n


def test_wal_reader_corrupt_middle_record() -> None:
    records = sample_records()
    data = bytearray(log_bytes(records))
    cuts = boundaries(records)
    data[cuts[3] + HEADER_SIZE + 2] ^= 0x40
    with pytest.raises(WalCorrupt) as info:
        read_wal(bytes(data))
    err = info.value
    assert err.offset == cuts[3]
    message = str(err)
    assert f"corrupt at byte {cuts[3]}" in message
    assert "--sessions-cache" in message and "move" in message
    assert "/srv/s/wal.log" in str(err.with_path("/srv/s/wal.log"))
    again = pickle.loads(pickle.dumps(err.with_path("/p/wal.log")))
    assert str(again) == str(err.with_path("/p/wal.log"))


def test_wal_reader_damaged_length_is_not_a_torn_tail() -> None:
    # A length bumped past EOF would make a middle record look like a short
    # final one; the valid record after it gives the damage away.
    records = sample_records()
    data = bytearray(log_bytes(records))
    at = boundaries(records)[4]
    length = int.from_bytes(data[at : at + 4], "little")
    data[at : at + 4] = (length + 10_000).to_bytes(4, "little")
    with pytest.raises(WalCorrupt, match="damaged length") as info:
        read_wal(bytes(data))
    assert info.value.offset == at
    # ... and a length bumped to end exactly at EOF
    data = bytearray(log_bytes(records))
    data[at : at + 4] = (len(data) - at - HEADER_SIZE).to_bytes(4, "little")
    with pytest.raises(WalCorrupt, match="damaged length"):
        read_wal(bytes(data))


def test_wal_reader_oversized_length() -> None:
    records = sample_records()
    data = log_bytes(records)
    header = (2**32 - 1).to_bytes(4, "little") + b"\x01" * 8
    got, end = read_wal(data + header + b"\0" * 100)
    assert got == records and end.torn and "limit" in end.reason
    with pytest.raises(WalCorrupt, match="limit"):
        read_wal(data + header + b"\x01" * 100)


def test_wal_reader_valid_checksum_but_garbage_payload() -> None:
    bad_id = {"session": "s", "event_id": -1, "epoch": 0, "ts": 0, "body": {"type": "cancelled"}}
    for payload in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"session": "s"}), msgpack.packb(bad_id)):
        data = MAGIC + len(payload).to_bytes(4, "little") + wal_checksum(payload).to_bytes(8, "little") + payload
        with pytest.raises(WalCorrupt, match="checksum matches") as info:
            read_wal(data)
        assert info.value.offset == len(MAGIC)


def test_wal_reader_keeps_raising_after_corruption() -> None:
    reader = WalReader()
    reader.receive_data(b"NOTAWAL!")
    with pytest.raises(WalCorrupt):
        reader.next_record()
    with pytest.raises(WalCorrupt):
        reader.next_record()


def test_wal_reader_bounded_by_max_record_size() -> None:
    big = rec("s", 0, body_prompt(tokens=list(range(1000))))
    data = MAGIC + encode_record(big)
    assert read_wal(data)[0] == [big]
    # over the limit, its length is not trusted: non-zero bytes follow, so it is damage
    with pytest.raises(WalCorrupt, match="limit"):
        read_wal(data, max_record_size=100)


def test_wal_proto_stays_pure() -> None:
    source = Path(_wal.__file__).read_text()
    assert not re.search(r"^\s*(import|from)\s+(trio|os|time|socket|subprocess)\b", source, re.MULTILINE)
    assert "async def" not in source
