"""A finished generation session is packed in memory (issue 24): it replays exactly as
before, and a short one retains about a third of the heap it used to."""

from __future__ import annotations

import gc
import os
import random
import tracemalloc
from typing import TYPE_CHECKING, Any

from superfluid.journal import JournalConfig, SessionLog, _journal, open_journal
from superfluid.proto import Sampling
from superfluid.proto._wal import (
    WalRecord,
    body_cancelled,
    body_created,
    body_finished,
    body_generated,
    body_prompt,
    ends_session,
)
from superfluid.proto._wal_conversation import body_conversation

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pathlib import Path

    import pytest

T0 = 1_700_000_000_000


def params(**extra: Any) -> dict[str, Any]:
    return {**Sampling(temperature=0.0).to_dict(), "max_new": 16, "ignore_eos": True, "stops": [],
            "kind": "completion", "resumable": False, **extra}


def records(sid: str, bodies: Iterable[dict[str, Any]], *, first_id: int = 0,
            ts: Iterable[int] | None = None) -> list[WalRecord]:
    bodies = list(bodies)
    stamps = list(ts) if ts is not None else [T0 + 7 * i for i in range(len(bodies))]
    return [WalRecord(session=sid, event_id=first_id + i, epoch=1, ts=stamps[i], body=body)
            for i, body in enumerate(bodies)]


def short_session(sid: str) -> list[WalRecord]:
    """The shape of a typical short request (as measured for issue 24)."""
    spans = [body_generated(tokens=[1, 2, 3, 4], text=" the cat sat") for _ in range(4)]
    return records(sid, [body_created(params=params(), klass="agent", model="mock", tenant="t1"),
                         body_prompt(tokens=list(range(12))), *spans,
                         body_finished(finish="length")])


def fed(recs: list[WalRecord]) -> SessionLog:
    slog = SessionLog(recs[0].session)
    for seq, rec in enumerate(recs):
        assert slog.apply(rec, seq)
    return slog


def live(recs: list[WalRecord]) -> SessionLog:
    """The same log, back in the form it has while generating."""
    slog = fed(recs)
    if type(slog._index) is bytes:
        slog._unpack()
    assert type(slog._index) is tuple
    return slog


PUBLIC = ("session", "created", "conversation", "open_turn", "prompt_tokens", "generated_tokens", "finish",
          "error", "last_event_id", "epoch", "first_ts", "last_ts", "first_seq", "last_seq", "text",
          "prompt_text", "event_count", "events", "tenant", "done", "cancelled")


def assert_same(packed: SessionLog, reference: SessionLog, recs: list[WalRecord]) -> None:
    assert type(packed._index) is bytes, "an ended generation session is packed"
    for name in PUBLIC:
        assert getattr(packed, name) == getattr(reference, name), name
    assert packed.records() == recs
    ids = [r.event_id for r in recs]
    step = max(1, len(ids) // 40)
    for after in sorted({-2, -1, ids[-1] + 1, *(i + d for i in ids[::step] + ids[-3:] for d in (-1, 0))}):
        expected = [r for r in recs if r.event_id > after]
        assert packed.records(after) == expected == reference.records(after), after
    assert type(packed._index) is bytes, "reading does not unpack"
    assert packed.text == "".join(r.body.get("text") or "" for r in recs if r.body["type"] == "generated")
    assert packed.prompt_text == "".join(r.body.get("text") or "" for r in recs if r.body["type"] == "prompt")
    assert packed.generated_tokens.tolist() == [t for r in recs if r.body["type"] == "generated"
                                                for t in r.body["tokens"]]
    assert packed.prompt_tokens.tolist() == [t for r in recs if r.body["type"] == "prompt" for t in r.body["tokens"]]


def test_a_packed_session_reads_exactly_like_the_live_one() -> None:
    recs = short_session("s-short")
    packed = fed(recs)
    assert_same(packed, live(recs), recs)
    assert packed.finish == "length" and packed.error is None and packed.tenant == "t1"
    assert packed.event_count == 7 and packed.last_event_id == 6
    assert packed.created == {"params": params(), "klass": "agent", "model": "mock", "tenant": "t1"}


def test_every_way_to_end_packs_and_replays_exactly() -> None:
    ends = {
        "span": records("s-span", [body_created(params=params(), klass="agent", model="m"),
                                   body_prompt(tokens=[5, 6], text="hé"),
                                   body_generated(tokens=[7], text="🙂 a"),
                                   body_generated(tokens=[], text=""),
                                   body_generated(tokens=[8, 9], text="b\n", finish="stop")]),
        "finished": records("s-fin", [body_created(params=params(seed=3), klass="batch", model="m"),
                                      body_prompt(tokens=[1], text=None), body_prompt(tokens=[2, 3], text="xy"),
                                      body_finished(finish="error", error={"code": 500, "message": "boom"})]),
        "cancelled": records("s-cancel", [body_created(params=params(), klass="agent", model="m"),
                                          body_prompt(tokens=[1, 2], text="ab"),
                                          body_generated(tokens=[3], text="c"), body_cancelled()]),
        "only_created": records("s-bare", [body_created(params=params(), klass="agent", model="m"),
                                           body_cancelled()]),
        "no_created": records("s-lost", [body_prompt(tokens=[4]), body_finished(finish="length")]),
    }
    for name, recs in ends.items():
        packed = fed(recs)
        assert packed.done, name
        assert_same(packed, live(recs), recs)
    assert fed(ends["cancelled"]).cancelled and fed(ends["finished"]).error == {"code": 500, "message": "boom"}


def test_a_long_session_with_restarts_and_clock_steps() -> None:
    """Wide values (70,000 prompt tokens, ids with gaps, several epochs, a clock that steps back)."""
    bodies = [body_created(params=params(), klass="agent", model="m"),
              body_prompt(tokens=[i % 50_000 for i in range(70_000)], text="p" * 70_000)]
    bodies += [body_generated(tokens=[i, i + 1], text=f"<{i}>") for i in range(300)]
    bodies.append(body_generated(tokens=[1], text="end", finish="length"))
    stamps = [T0 + 1000 * i if i < 150 else T0 - 2**33 + i for i in range(len(bodies))]
    recs = records("s-long", bodies, first_id=5000, ts=stamps)
    recs = [WalRecord(session=r.session, event_id=r.event_id * 3, epoch=1 + (i * 7) // len(recs), ts=r.ts,
                      body=r.body) for i, r in enumerate(recs)]
    packed = fed(recs)
    assert_same(packed, live(recs), recs)
    assert len(packed._index) < 57 * len(recs) // 2  # live, the index takes 57 bytes an event


def test_events_after_the_end_unpack_and_repack() -> None:
    """Replay is lenient: an event after the finish is applied (the packed log is unpacked
    first); the next end packs again; a duplicate changes nothing, packed or not."""
    recs = short_session("s-late")
    late = records("s-late", [body_generated(tokens=[9, 9], text="late"),
                              body_finished(finish="stop", error="after the fact"),
                              body_generated(tokens=[8], text="!", finish="length"),
                              body_cancelled()], first_id=7, ts=[T0 + 100, T0 + 90, T0 + 110, T0 + 120])
    slog = fed(recs)
    packed_before = slog._index
    assert not slog.apply(recs[3], 99) and not slog.apply(recs[-1], 99)  # duplicates
    assert slog._index is packed_before and slog.last_seq == 6
    for n in range(1, len(late) + 1):
        got = recs + late[:n]
        slog.apply(late[n - 1], 6 + n)
        reference = live(got)
        if late[n - 1].body["type"] == "generated" and late[n - 1].body["finish"] is None:
            assert type(slog._index) is tuple  # not an end: stays live
            for name in PUBLIC:
                assert getattr(slog, name) == getattr(reference, name), name
            assert slog.records() == got
        else:
            assert_same(slog, reference, got)
        assert not slog.apply(late[n - 1], 99)
    assert slog.finish == "cancelled" and slog.error == "after the fact"
    # the earlier ends keep their own bodies (not the session's last finish)
    bodies = [r.body for r in slog.records(5)]
    assert bodies[0] == {"type": "finished", "finish": "length", "error": None}
    assert bodies[2] == {"type": "finished", "finish": "stop", "error": "after the fact"}
    assert bodies[3]["finish"] == "length" and bodies[4] == {"type": "cancelled"}


def test_random_logs_replay_exactly_packed_or_not() -> None:
    """Seeded random sessions, lenient ones included (events after an end, several ends, a lost
    ``created``): after every record, the log reads exactly the records it took."""
    rng = random.Random(24)
    for n in range(150):
        sid = f"s-rand-{n}"
        slog = SessionLog(sid)
        taken: list[WalRecord] = []
        event_id, ts, epoch = rng.randrange(3), T0 + rng.randrange(10**6), 1 + rng.randrange(3)
        for k in range(rng.randrange(1, 14)):
            roll = rng.random()
            if k == 0 and roll < 0.9 or roll < 0.05:
                body = body_created(params=params(seed=rng.randrange(3)), klass="agent", model="m")
            elif roll < 0.3:
                body = body_prompt(tokens=[rng.randrange(2**32) for _ in range(rng.randrange(5))],
                                   text=rng.choice([None, "", "pé", "x" * rng.randrange(300)]))
            elif roll < 0.8:
                body = body_generated(tokens=[rng.randrange(70_000) for _ in range(rng.randrange(4))],
                                      text=rng.choice(["", "a", "🙂b", "y" * rng.randrange(300)]),
                                      finish=rng.choice([None] * 4 + ["stop", "length"]))
            elif roll < 0.92:
                body = body_finished(finish=rng.choice(["error", "stop"]),
                                     error=rng.choice([None, "boom", {"code": rng.randrange(600)}]))
            else:
                body = body_cancelled()
            event_id += rng.choice([1, 1, 1, 2, 300])
            ts = max(0, ts + rng.choice([0, 1, 5, 70_000, -3, -(2**20)]))
            epoch += rng.random() < 0.1
            rec = WalRecord(session=sid, event_id=event_id, epoch=epoch, ts=ts, body=body)
            assert slog.apply(rec, len(taken))
            taken.append(rec)
            assert not slog.apply(rec, 999)
            assert slog.records() == taken and slog.event_count == len(taken)
            assert slog.records(taken[len(taken) // 2].event_id) == taken[len(taken) // 2 + 1:]
            assert (type(slog._index) is bytes) == (slog.done and ends_session(body))
        reference = live(taken)
        for name in PUBLIC:
            assert getattr(slog, name) == getattr(reference, name), name


def test_equal_created_bodies_are_one_shared_dict() -> None:
    a, b = fed(short_session("s-a")), fed(short_session("s-b"))
    c = fed(records("s-c", [body_created(params=params(seed=7), klass="agent", model="mock", tenant="t1"),
                            body_cancelled()]))
    assert a.created is b.created and a.created is not c.created
    assert a.records()[0].body == short_session("s-a")[0].body and b.records()[0].body["params"] == params()
    # types are part of equality here: 1.0 is not 1 and True is not 1
    d = fed(records("s-d", [body_created(params={"x": 1}, klass="agent", model="m"), body_cancelled()]))
    e = fed(records("s-e", [body_created(params={"x": 1.0}, klass="agent", model="m"), body_cancelled()]))
    f = fed(records("s-f", [body_created(params={"x": True}, klass="agent", model="m"), body_cancelled()]))
    assert d.created is not e.created and d.created is not f.created and e.created is not f.created
    assert type(e.records()[0].body["params"]["x"]) is float and f.records()[0].body["params"]["x"] is True


def test_conversations_are_not_packed() -> None:
    """Not even after an end (one never comes through the journal; replay would still take it)."""
    recs = records("c-1", [body_conversation(model="m", tenant="t"), body_finished(finish="stop")])
    slog = fed(recs)
    assert slog.done and type(slog._index) is tuple and slog.records() == recs


async def test_a_short_finished_session_retains_about_a_kilobyte(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """500 short finished sessions through the journal: the heap they keep, per session (the
    session id and the journal's dict slot included). Packed: ~0.85 KB; unpacked it was ~3.2 KB."""

    def write(fd: int, data: bytes, committed: int, *, full: bool) -> None:  # no fsync: memory is measured
        assert os.write(fd, data) == len(data)

    monkeypatch.setattr(_journal, "write_and_sync", write)
    n = 500
    async with open_journal(tmp_path, config=JournalConfig(compact_at_finished=10 * n, keep_finished=10 * n)) as j:
        async def one(i: int) -> None:
            sid = f"s-{i:032x}"
            await j.append_many([(sid, r.body) for r in short_session(sid)])

        for i in range(100):  # warm up: caches, the sessions dict
            await one(i)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for i in range(100, 100 + n):
                await one(i)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert len(j.sessions) == 100 + n
        trio_internals = [tracemalloc.Filter(False, "*/trio/*")]  # e.g. expired deadlines it prunes lazily
        grown = after.filter_traces(trio_internals).compare_to(before.filter_traces(trio_internals), "filename")
        per_session = sum(d.size_diff for d in grown) / n
        assert per_session <= 1500, f"{per_session:.0f} B retained per finished session"
        assert all(type(j.sessions[f"s-{i:032x}"]._index) is bytes for i in range(100, 100 + n))

