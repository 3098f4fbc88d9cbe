"""Property tests for the session-log scanner (``superfluid.proto._wal``).

Invariant: whatever the bytes, the reader yields records and then ends clean,
reports a torn tail, or raises ``WalCorrupt``, never anything else, and it
gives the same answer fed whole or in arbitrary pieces. For damage to a
valid log the answer is exact: a truncation or a zero-filled tail is a torn
tail that keeps every whole record before it; a single flipped bit is never
read as a clean log and never silently drops a record that is not the last.

Budget: ``SUPERFLUID_FUZZ_EXAMPLES`` examples per property (default 200).
"""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superfluid.proto._link import NEED_DATA
from superfluid.proto._wal import (
    MAGIC,
    WalCorrupt,
    WalEnd,
    WalReader,
    WalRecord,
    encode_record,
)

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("SUPERFLUID_FUZZ_EXAMPLES", "200"))
fuzz_settings = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=12)
texts = st.text(max_size=16)
finishes = st.none() | st.sampled_from(["eos", "length", "cancelled", "error"])
params = st.dictionaries(st.sampled_from(["temperature", "seed", "top_k"]),
                         st.integers(0, 100) | st.floats(0, 2), max_size=3)

bodies = st.one_of(
    st.builds(lambda p, k, m: {"type": "created", "params": p, "klass": k, "model": m},
              params, st.sampled_from(["agent", "interactive"]), st.text(max_size=8)),
    st.builds(lambda t, x: {"type": "prompt", "tokens": t, "text": x}, tokens, st.none() | texts),
    st.builds(lambda t, x, f: {"type": "generated", "tokens": t, "text": x, "finish": f}, tokens, texts, finishes),
    st.builds(lambda f, e: {"type": "finished", "finish": f, "error": e},
              st.sampled_from(["eos", "error"]), st.none() | texts),
    st.just({"type": "cancelled"}),
    # conversations (SPEC.md §7, "Conversations")
    st.builds(lambda m, x, p: {"type": "conversation", "model": m or "m", "system": x, "tools": None, "sampling": p,
                               "template_kwargs": {}}, st.text(max_size=8), st.none() | texts, params),
    st.builds(lambda r, x: {"type": "message", "message": {"role": r, "content": x}, "turn": None, "finish": None},
              st.sampled_from(["system", "user", "assistant", "tool"]), st.none() | texts),
    st.builds(lambda x, t, f: {"type": "message", "message": {"role": "assistant", "content": x}, "turn": t,
                               "finish": f}, texts, st.integers(0, 2**40), st.sampled_from(["stop", "length"])),
    st.builds(lambda g, p: {"type": "turn", "generation": g or "g", "params": {"sampling": p}},
              st.text(max_size=8), params),
    st.builds(lambda t, e: {"type": "turn_end", "turn": t, "finish": "error", "error": e},
              st.integers(0, 2**40), st.none() | texts),
    st.builds(lambda s, a: {"type": "fork", "source": s or "s", "at": a}, st.text(max_size=8), st.integers(0, 2**40)),
)


@st.composite
def records(draw: st.DrawFn) -> WalRecord:
    body = draw(bodies)
    session = draw(st.sampled_from(["a", "b", "session-xyz"]))
    return WalRecord(session=session, event_id=draw(st.integers(0, 2**40)), epoch=draw(st.integers(0, 9)),
                     ts=draw(st.integers(0, 2**45)), body=body)


logs = st.lists(records(), min_size=1, max_size=8)


def encode_log(recs: list[WalRecord]) -> tuple[bytes, list[int]]:
    """The log's bytes and the offset where each record starts (plus the end)."""
    out = bytearray(MAGIC)
    starts = []
    for r in recs:
        starts.append(len(out))
        out += encode_record(r)
    return bytes(out), [*starts, len(out)]


def scan(data: bytes, cuts: list[int] | None = None) -> tuple[list[WalRecord], WalEnd | WalCorrupt]:
    """Feed ``data`` split at ``cuts``; return the records and the outcome.
    Any exception other than WalCorrupt fails the test."""
    reader = WalReader()
    points = sorted({c for c in (cuts or []) if 0 < c < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    got: list[WalRecord] = []
    failure: WalCorrupt | None = None
    try:
        for piece in [*(p for p in pieces if p), b""]:  # b"" is EOF
            reader.receive_data(piece)
            while True:
                item = reader.next_record()
                if item is NEED_DATA:
                    break
                if isinstance(item, WalEnd):
                    assert 0 <= item.offset <= item.size == len(data)
                    assert reader.next_record() is item
                    return got, item
                assert isinstance(item, WalRecord)
                got.append(item)
    except WalCorrupt as exc:
        failure = exc
    assert failure is not None, "the reader did not finish after EOF"
    assert 0 <= failure.offset <= len(data)
    assert "--sessions-cache" in str(failure)
    return got, failure


def same(a: tuple[list[WalRecord], WalEnd | WalCorrupt], b: tuple[list[WalRecord], WalEnd | WalCorrupt]) -> bool:
    if isinstance(a[1], WalCorrupt) or isinstance(b[1], WalCorrupt):
        return (isinstance(a[1], WalCorrupt) and isinstance(b[1], WalCorrupt)
                and a[1].offset == b[1].offset and a[0] == b[0])
    return a == b


@fuzz_settings
@given(data=st.binary(max_size=512), magic=st.booleans(), cuts=st.lists(st.integers(0, 600), max_size=6))
def test_fuzz_wal_arbitrary_bytes(data: bytes, magic: bool, cuts: list[int]) -> None:
    data = MAGIC + data if magic else data
    whole = scan(data)
    assert same(whole, scan(data, cuts))
    end = whole[1]
    if isinstance(end, WalEnd) and end.clean:
        assert end.offset == len(data)


@fuzz_settings
@given(recs=logs, cuts=st.lists(st.integers(0, 4096), max_size=8))
def test_fuzz_wal_valid_log_round_trips_in_any_pieces(recs: list[WalRecord], cuts: list[int]) -> None:
    data, _ = encode_log(recs)
    got, end = scan(data, cuts)
    assert got == recs
    assert end == WalEnd(offset=len(data), size=len(data), torn=False)


@fuzz_settings
@given(recs=logs, where=st.floats(0, 1, exclude_max=True), cuts=st.lists(st.integers(0, 4096), max_size=4))
def test_fuzz_wal_truncation_is_a_torn_tail(recs: list[WalRecord], where: float, cuts: list[int]) -> None:
    data, starts = encode_log(recs)
    cut = int(where * len(data))
    got, end = scan(data[:cut], cuts)
    assert isinstance(end, WalEnd)
    if cut < len(MAGIC):
        assert got == [] and end.offset == 0 and end.torn == (cut > 0)
        return
    kept = max(i for i, s in enumerate(starts) if s <= cut)
    assert got == recs[:kept]
    assert end.offset == starts[kept]
    assert end.torn == (cut != starts[kept])


@fuzz_settings
@given(recs=logs, zeros=st.integers(1, 5000))
def test_fuzz_wal_zero_filled_tail_is_torn(recs: list[WalRecord], zeros: int) -> None:
    data, _ = encode_log(recs)
    got, end = scan(data + b"\0" * zeros)
    assert got == recs
    assert isinstance(end, WalEnd) and end.torn and end.offset == len(data)


@fuzz_settings
@given(recs=logs, where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7),
       cuts=st.lists(st.integers(0, 4096), max_size=4))
def test_fuzz_wal_single_bit_flip_is_detected(recs: list[WalRecord], where: float, bit: int,
                                              cuts: list[int]) -> None:
    data, starts = encode_log(recs)
    pos = int(where * len(data))
    damaged = bytearray(data)
    damaged[pos] ^= 1 << bit
    result = scan(bytes(damaged))
    assert same(result, scan(bytes(damaged), cuts))
    got, end = result
    if isinstance(end, WalCorrupt):
        # everything before the damage is still read
        assert got == recs[: sum(1 for s in starts[:-1] if s < end.offset)]
        return
    # Only the last record may be taken for a torn tail, and only if the flip is in it.
    assert end.torn
    assert pos >= starts[-2]
    assert end.offset == starts[-2]
    assert got == recs[:-1]


@fuzz_settings
@given(recs=logs, edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                                 min_size=1, max_size=6))
def test_fuzz_wal_random_damage_never_crashes(recs: list[WalRecord], edits: list[tuple[float, int]]) -> None:
    data, starts = encode_log(recs)
    damaged = bytearray(data)
    for where, value in edits:
        damaged[int(where * len(damaged))] = value
    got, end = scan(bytes(damaged))
    first = min(int(w * len(data)) for w, _ in edits)
    # records wholly before the first edit are always read back
    intact = [r for r, (_, e) in zip(recs, itertools.pairwise(starts), strict=True) if e <= first]
    assert got[: len(intact)] == intact
    if isinstance(end, WalEnd) and end.clean:
        # every byte is covered by the magic or a checksum: changed bytes are never clean
        assert bytes(damaged) == data and got == recs
