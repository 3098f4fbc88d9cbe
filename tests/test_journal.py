"""The session journal: open/replay/repair, locking, epochs, group commit, compaction."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from superfluid.journal import (
    JournalClosed,
    JournalConfig,
    JournalLocked,
    JournalWriteError,
    SessionStateError,
    WalCorrupt,
    _journal,
    open_journal,
)
from superfluid.proto._wal import (
    HEADER_SIZE,
    MAGIC,
    WalRecord,
    body_cancelled,
    body_created,
    body_finished,
    body_generated,
    body_prompt,
    read_wal,
)

if TYPE_CHECKING:
    from pathlib import Path

PARAMS = {"temperature": 0.0, "top_p": 1.0, "seed": 3}


def created(model: str = "mock") -> dict:
    return body_created(params=PARAMS, klass="agent", model=model)


def wal(tmp_path: Path) -> Path:
    return tmp_path / "wal.log"


async def write_session(journal: _journal.Journal, sid: str, *, spans: int = 3, finish: str | None = "eos") -> None:
    await journal.append_many([(sid, created()), (sid, body_prompt(tokens=[1, 2, 3], text="abc"))])
    for i in range(spans):
        last = i == spans - 1
        await journal.append(sid, body_generated(tokens=[10 + i, 20 + i], text=f"<{i}é>",
                                                 finish=finish if last else None))


async def test_journal_open_creates_log_with_epoch(tmp_path: Path) -> None:
    directory = tmp_path / "sessions" / "nested"
    async with open_journal(directory) as journal:
        assert journal.epoch == 1
        assert journal.sessions == {}
        stats = journal.statistics()
        assert stats.epoch == 1 and stats.records == 1 and stats.replayed == 0
    data = (directory / "wal.log").read_bytes()
    assert data.startswith(MAGIC)
    records, end = read_wal(data)
    assert end.clean
    assert [r.body for r in records] == [{"type": "epoch_bump"}]
    assert (directory / "serve.lock").read_text().strip() == str(os.getpid())


async def test_journal_epoch_increments_across_reopen(tmp_path: Path) -> None:
    epochs = []
    for _ in range(3):
        async with open_journal(tmp_path) as journal:
            epochs.append(journal.epoch)
            sid = f"s{journal.epoch}"
            await journal.append(sid, created())
    assert epochs == [1, 2, 3]
    records, _ = read_wal(wal(tmp_path).read_bytes())
    assert [r.epoch for r in records if r.session == ""] == [1, 2, 3]
    assert [r.event_id for r in records if r.session == ""] == [0, 1, 2]
    assert {r.session: r.epoch for r in records if r.session} == {"s1": 1, "s2": 2, "s3": 3}


async def test_journal_replay_reconstructs_session_exactly(tmp_path: Path) -> None:
    committed: list[WalRecord] = []
    async with open_journal(tmp_path) as journal:
        committed += await journal.append_many([("a", created()), ("a", body_prompt(tokens=[5, 6, 7]))])
        committed += await journal.append_many([("b", created("other"))])
        committed.append(await journal.append("a", body_prompt(tokens=[8], text="more")))
        for i, piece in enumerate(["Hel", "lo, ", "wör", "", "ld 🌍"]):
            committed.append(await journal.append("a", body_generated(tokens=[100 + i], text=piece)))
        committed.append(await journal.append("a", body_generated(tokens=[], text="", finish="length")))
        live = journal.sessions["a"]
        before = (live.records(), list(live.prompt_tokens), list(live.generated_tokens), live.text)
    assert [r.event_id for r in committed if r.session == "a"] == list(range(9))
    async with open_journal(tmp_path) as journal:
        a = journal.sessions["a"]
        assert a.records() == [r for r in committed if r.session == "a"] == before[0]
        assert a.events == a.records()
        assert list(a.prompt_tokens) == [5, 6, 7, 8] == before[1]
        assert list(a.generated_tokens) == [100, 101, 102, 103, 104] == before[2]
        assert a.text == "Hello, wörld 🌍" == before[3]
        assert a.prompt_text == "more"
        assert a.finish == "length" and a.done and not a.cancelled
        assert a.created == {"params": PARAMS, "klass": "agent", "model": "mock"}
        assert a.last_event_id == 8
        assert [r.event_id for r in a.records(after=5)] == [6, 7, 8]
        assert a.records(after=8) == []
        b = journal.sessions["b"]
        assert not b.done and b.last_event_id == 0
        assert journal.interrupted() == [b]


async def test_journal_resumes_interrupted_session(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await write_session(journal, "s", spans=2, finish=None)
    async with open_journal(tmp_path) as journal:
        (s,) = journal.interrupted()
        assert s.session == "s" and s.epoch == 1 and journal.epoch == 2
        assert list(s.prompt_tokens) + list(s.generated_tokens) == [1, 2, 3, 10, 20, 11, 21]
        record = await journal.append("s", body_generated(tokens=[12], text="!", finish="eos"))
        assert record.event_id == s.last_event_id == 4 and record.epoch == 2
        assert journal.interrupted() == []
    async with open_journal(tmp_path) as journal:
        ids = [r.event_id for r in journal.sessions["s"].records()]
        assert ids == list(range(5))
        assert journal.sessions["s"].text == "<0é><1é>!"


async def test_journal_torn_tail_short_record_is_truncated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with open_journal(tmp_path) as journal:
        await write_session(journal, "s", spans=3, finish=None)
    data = wal(tmp_path).read_bytes()
    wal(tmp_path).write_bytes(data[:-5])  # the last span was cut mid-write
    with caplog.at_level(logging.WARNING, logger="superfluid.journal"):
        async with open_journal(tmp_path) as journal:
            stats = journal.statistics()
            s = journal.sessions["s"]
            assert s.text == "<0é><1é>" and s.last_event_id == 3
            assert stats.truncated_bytes > 0
            # appendable afterwards, and the id of the lost span is reused
            record = await journal.append("s", body_generated(tokens=[7], text="x"))
            assert record.event_id == 4
    assert "torn tail" in caplog.text
    async with open_journal(tmp_path) as journal:
        assert journal.statistics().truncated_bytes == 0
        assert journal.sessions["s"].text == "<0é><1é>x"


async def test_journal_torn_tail_bad_checksum_then_zeros(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await write_session(journal, "s", spans=2, finish="eos")
    data = bytearray(wal(tmp_path).read_bytes())
    records, _ = read_wal(bytes(data))
    last_len = len(data) - len(MAGIC) - sum(len(_enc(r)) for r in records[:-1])
    start = len(data) - last_len
    data[start + HEADER_SIZE + 3 :] = b"\0" * (last_len - HEADER_SIZE - 3)
    wal(tmp_path).write_bytes(bytes(data) + b"\0" * 8192)  # and a zero-filled extension
    async with open_journal(tmp_path) as journal:
        s = journal.sessions["s"]
        assert not s.done and s.text == "<0é>"
        await journal.append("s", body_finished(finish="eos"))
        assert journal.statistics().truncated_bytes == last_len + 8192
    async with open_journal(tmp_path) as journal:
        assert journal.sessions["s"].finish == "eos"
        assert journal.statistics().truncated_bytes == 0


def _enc(record: WalRecord) -> bytes:
    from superfluid.proto._wal import encode_record

    return encode_record(record)


async def _corrupt_middle(tmp_path: Path) -> bytes:
    async with open_journal(tmp_path) as journal:
        await write_session(journal, "s", spans=3)
        await write_session(journal, "t", spans=3)
    data = bytearray(wal(tmp_path).read_bytes())
    data[len(data) // 2] ^= 0x01
    wal(tmp_path).write_bytes(bytes(data))
    return bytes(data)


async def test_journal_corrupt_middle_record_refuses_to_open(tmp_path: Path) -> None:
    damaged = await _corrupt_middle(tmp_path)
    with pytest.raises(WalCorrupt) as info:
        async with open_journal(tmp_path):
            raise AssertionError("opened a corrupt log")
    message = str(info.value)
    assert str(wal(tmp_path)) in message
    assert "--sessions-cache" in message and "move" in message
    assert 0 < info.value.offset < len(damaged)
    assert wal(tmp_path).read_bytes() == damaged  # untouched
    # the lock was released: a fresh open works
    async with open_journal(tmp_path, fresh=True):
        pass


async def test_journal_fresh_moves_corrupt_log_aside(tmp_path: Path) -> None:
    damaged = await _corrupt_middle(tmp_path)
    async with open_journal(tmp_path, fresh=True) as journal:
        assert journal.sessions == {}
        assert journal.epoch == 2  # still above the damaged log's epochs
        await journal.append("new", created())
    assert (tmp_path / "wal.log.corrupt-1").read_bytes() == damaged
    async with open_journal(tmp_path) as journal:
        assert set(journal.sessions) == {"new"} and journal.epoch == 3
    # a second damaged log does not overwrite the first one kept
    await _corrupt_middle(tmp_path)
    async with open_journal(tmp_path, fresh=True):
        pass
    assert (tmp_path / "wal.log.corrupt-1").read_bytes() == damaged
    assert (tmp_path / "wal.log.corrupt-2").exists()


async def test_journal_fresh_keeps_healthy_log_as_prev(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await write_session(journal, "s")
    old = wal(tmp_path).read_bytes()
    async with open_journal(tmp_path, fresh=True) as journal:
        assert journal.sessions == {} and journal.epoch == 2
    assert (tmp_path / "wal.log.prev").read_bytes() == old


async def test_journal_second_open_is_locked(tmp_path: Path) -> None:
    async with open_journal(tmp_path):
        with pytest.raises(JournalLocked) as info:
            async with open_journal(tmp_path):
                raise AssertionError("two journals on one directory")
        assert info.value.pid == os.getpid()
        assert str(tmp_path) in str(info.value) and str(os.getpid()) in str(info.value)
    async with open_journal(tmp_path):  # released on close
        pass


async def test_journal_lock_conflicts_across_processes(tmp_path: Path) -> None:
    script = (
        "import sys, trio\n"
        "from superfluid.journal import open_journal, JournalLocked\n"
        "async def main():\n"
        "    try:\n"
        "        async with open_journal(sys.argv[1]):\n"
        "            pass\n"
        "    except JournalLocked as exc:\n"
        "        print(exc)\n"
        "        sys.exit(3)\n"
        "trio.run(main)\n"
    )
    with trio.fail_after(30):
        async with open_journal(tmp_path):
            proc = await trio.run_process([sys.executable, "-c", script, str(tmp_path)], check=False,
                                          capture_stdout=True)
    assert proc.returncode == 3
    assert f"pid {os.getpid()}" in proc.stdout.decode()


async def test_journal_group_commit_batches_concurrent_appenders(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await journal.append_many([(f"s{i}", created()) for i in range(20)])
        start = journal.statistics()
        assert start.batches == 1

        async def appender(i: int) -> None:
            for k in range(5):
                record = await journal.append(f"s{i}", body_generated(tokens=[k], text=str(k)))
                assert record.event_id == k + 1

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(appender, i)
        stats = journal.statistics()
        appends = stats.appended - start.appended
        fsyncs = stats.fsyncs - start.fsyncs
        assert appends == 100
        print("group commit:", appends, "appends,", fsyncs, "fsyncs")
        assert fsyncs <= 15, stats  # 100 appends; typically ~6 fsyncs
        assert stats.batches - start.batches == fsyncs
        for i in range(20):
            assert journal.sessions[f"s{i}"].text == "01234"


async def test_journal_writes_on_the_event_loop_only_while_the_disk_is_fast(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk's speed is what ``_timed_write`` reports: set by the test, not measured,
    so a loaded machine cannot make a fast write look slow."""
    real = _journal.write_and_sync
    ran_on: list[bool] = []   # True: on the event loop's thread
    delay = [0.0]

    def observed(*args: object, **kw: object) -> float:
        ran_on.append(threading.current_thread() is threading.main_thread())
        real(*args, **kw)  # type: ignore[arg-type]
        return delay[0]

    async with open_journal(tmp_path) as journal:
        monkeypatch.setattr(_journal, "_timed_write", observed)
        await journal.append("a", created())
        delay[0] = 0.05                      # the disk turns slow: this commit still runs inline...
        await journal.append("a", body_prompt(tokens=[1]))
        delay[0] = 0.0
        for k in range(30):                  # ...the next ones go to a thread until the average recovers
            await journal.append("a", body_generated(tokens=[k], text="x"))
        assert ran_on[:3] == [True, True, False]
        assert ran_on[-1] is True
    async with open_journal(tmp_path, config=JournalConfig(inline_sync_s=0)) as journal:
        ran_on.clear()
        await journal.append("b", created())
        assert ran_on == [False]


async def test_journal_append_many_is_one_fsync(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        before = journal.statistics()
        records = await journal.append_many(
            [("a", created()), ("b", created())]
            + [(sid, body_generated(tokens=[i], text="x")) for i in range(50) for sid in ("a", "b")]
        )
        after = journal.statistics()
        assert after.fsyncs - before.fsyncs == 1 and after.batches - before.batches == 1
        assert [r.event_id for r in records if r.session == "a"] == list(range(51))
        assert after.bytes == wal(tmp_path).stat().st_size


async def test_journal_session_rules(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        with pytest.raises(SessionStateError, match="first event"):
            await journal.append("x", body_prompt(tokens=[1]))
        await journal.append("x", created())
        with pytest.raises(SessionStateError, match="already exists"):
            await journal.append("x", created())
        with pytest.raises(ValueError, match="non-empty"):
            await journal.append("", created())
        with pytest.raises(ValueError, match="epoch bumps"):
            await journal.append("x", {"type": "epoch_bump"})
        with pytest.raises(ValueError, match="tokens"):
            await journal.append("x", {"type": "prompt", "tokens": [-1]})
        # all or nothing: the valid first item of a failing call is not queued
        with pytest.raises(SessionStateError):
            await journal.append_many([("x", body_prompt(tokens=[1])), ("y", body_prompt(tokens=[1]))])
        assert journal.sessions["x"].last_event_id == 0
        assert (await journal.append("x", body_prompt(tokens=[1]))).event_id == 1
        # finishing, in the same call as more events
        with pytest.raises(SessionStateError, match="finished"):
            await journal.append_many([("x", body_cancelled()), ("x", body_prompt(tokens=[2]))])
        await journal.append("x", body_cancelled())
        with pytest.raises(SessionStateError, match="finished"):
            await journal.append("x", body_finished(finish="eos"))
        assert journal.sessions["x"].cancelled
        assert await journal.append_many([]) == []


async def test_journal_cancelled_follower_is_still_committed(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = _journal.write_and_sync

    def gated(*args: object, **kw: object) -> None:
        gate.wait(10)
        real(*args, **kw)  # type: ignore[arg-type]

    # the gate blocks the writer: it must be a thread, not the event loop
    async with open_journal(tmp_path, config=JournalConfig(inline_sync_s=0)) as journal:
        await journal.append_many([("a", created()), ("b", created())])
        monkeypatch.setattr(_journal, "write_and_sync", gated)
        follower = trio.CancelScope()

        async def follow() -> None:
            with follower:
                await journal.append("b", body_prompt(tokens=[2]))
            assert follower.cancelled_caught

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(journal.append, "a", body_prompt(tokens=[1]))  # leads; fsync held at the gate
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(follow)
                await trio.testing.wait_all_tasks_blocked()
                assert journal.statistics().pending_records == 1
                follower.cancel()
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
        # the leader wrote the cancelled follower's record after its own
        assert journal.sessions["b"].last_event_id == 1
        assert journal.statistics().pending_records == 0
    async with open_journal(tmp_path) as journal:
        assert list(journal.sessions["b"].prompt_tokens) == [2]


async def test_journal_cancelled_before_queueing_writes_nothing(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await journal.append("a", created())
        with trio.CancelScope() as scope:
            scope.cancel()
            await journal.append("a", body_prompt(tokens=[1]))
        assert journal.sessions["a"].last_event_id == 0
        assert (await journal.append("a", body_prompt(tokens=[1]))).event_id == 1


async def test_journal_close_rejects_appends(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await journal.append("a", created())
    with pytest.raises(JournalClosed):
        await journal.append("a", body_prompt(tokens=[1]))


async def test_journal_write_failure_breaks_the_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_journal(tmp_path) as journal:
        await journal.append("a", created())

        def failing(*_args: object, **_kw: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(_journal, "write_and_sync", failing)
        with pytest.raises(JournalWriteError, match="No space"):
            await journal.append("a", body_prompt(tokens=[1]))
        monkeypatch.undo()
        with pytest.raises(JournalWriteError, match="takes no records until"):
            await journal.append("a", body_prompt(tokens=[1]))
    async with open_journal(tmp_path) as journal:
        assert journal.sessions["a"].last_event_id == 0


async def test_journal_compaction_keeps_unfinished_and_recent(tmp_path: Path) -> None:
    config = JournalConfig(keep_finished=3, keep_interrupted=1)
    async with open_journal(tmp_path, config=config) as journal:
        await write_session(journal, "old-interrupted", finish=None)
        await write_session(journal, "interrupted", finish=None)
    async with open_journal(tmp_path, config=config) as journal:
        for i in range(10):
            await write_session(journal, f"done{i}", spans=4)
        await write_session(journal, "live", spans=2, finish=None)
        expect = {sid: journal.sessions[sid].records() for sid in ("live", "interrupted", "done9")}
        size_before = wal(tmp_path).stat().st_size
        old_bytes = wal(tmp_path).read_bytes()
        await journal.compact()
        stats = journal.statistics()
        assert stats.compactions == 1
        assert set(journal.sessions) == {"interrupted", "live", "done7", "done8", "done9"}
        assert stats.bytes == wal(tmp_path).stat().st_size < size_before / 2
        for sid, records in expect.items():
            assert journal.sessions[sid].records() == records
        # kept records are rewritten byte for byte
        new_records, end = read_wal(wal(tmp_path).read_bytes())
        assert end.clean
        assert all(_enc(r) in old_bytes for r in new_records)
        assert new_records[0].body == {"type": "epoch_bump"}
        assert new_records[0].epoch == journal.epoch
        # the log stays appendable, and dropped sessions are gone for good
        await journal.append("live", body_generated(tokens=[1], text="+", finish="eos"))
        with pytest.raises(SessionStateError):
            await journal.append("old-interrupted", body_cancelled())
        in_memory = {sid: s.records() for sid, s in journal.sessions.items()}
    assert not (tmp_path / "wal.log.compact").exists()
    async with open_journal(tmp_path, config=config) as journal:
        assert {sid: s.records() for sid, s in journal.sessions.items()} == in_memory
        assert journal.epoch == 3


async def test_journal_memory_stays_bounded_by_finished_sessions(tmp_path: Path) -> None:
    """Short requests fill memory long before the log reaches 64 MiB: past
    ``compact_at_finished`` finished sessions (at least 1.5 x ``keep_finished``) the log
    compacts, so the index holds a bounded number of sessions however many ran."""
    config = JournalConfig(keep_finished=5, compact_at_finished=10)
    async with open_journal(tmp_path, config=config) as journal:
        await write_session(journal, "live", spans=1, finish=None)
        most = 0
        for i in range(200):
            await write_session(journal, f"s{i}", spans=2)
            most = max(most, len(journal.sessions))
        assert most <= 1 + 10 + 1
        assert journal.statistics().compactions >= 15
        assert "live" in journal.sessions and "s199" in journal.sessions
        kept = set(journal.sessions)
    async with open_journal(tmp_path, config=config) as journal:
        assert set(journal.sessions) == kept


async def test_journal_compacts_when_the_log_grows(tmp_path: Path) -> None:
    config = JournalConfig(compact_at_bytes=16 * 1024, keep_finished=2)
    async with open_journal(tmp_path, config=config) as journal:
        await write_session(journal, "live", spans=1, finish=None)
        for i in range(100):
            await write_session(journal, f"s{i}", spans=3)
            assert wal(tmp_path).stat().st_size < 2 * 16 * 1024
        stats = journal.statistics()
        assert stats.compactions >= 3
        assert "live" in journal.sessions and "s0" not in journal.sessions
        assert len(journal.sessions) < 50
        await journal.compact()
        assert set(journal.sessions) == {"live", "s98", "s99"}
        assert journal.sessions["live"].text == "<0é>"
    async with open_journal(tmp_path, config=config) as journal:
        assert set(journal.sessions) == {"live", "s98", "s99"}


async def test_journal_bounded_queue_applies_backpressure(tmp_path: Path) -> None:
    config = JournalConfig(max_pending_bytes=1)
    async with open_journal(tmp_path, config=config) as journal:
        await journal.append_many([(f"s{i}", created()) for i in range(10)])

        async def appender(i: int) -> None:
            for k in range(3):
                await journal.append(f"s{i}", body_generated(tokens=[k], text="x"))
                assert journal.statistics().pending_records <= 1

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(appender, i)
        assert all(s.last_event_id == 3 for s in journal.sessions.values())
