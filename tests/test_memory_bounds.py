"""Per-request structures stay bounded however many requests a daemon serves
(issue 24: RSS after 20,000 requests within 10% of its level after 1,000;
``bench/overhead.py --memory-requests`` measures the whole daemon)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from superfluid.journal import JournalConfig, open_journal
from superfluid.proto import Sampling
from superfluid.sched import Job
from superfluid.sessions._resumable import SessionStore

if TYPE_CHECKING:
    from pathlib import Path


async def test_the_session_index_holds_running_sessions_not_every_one_served(tmp_path: Path) -> None:
    """A plain session leaves the store's index when its request retires after its end
    (a lookup reads it from the log); a resumable one stays, within ``max_live``; nothing
    else in the store grows per request."""
    async with open_journal(tmp_path, config=JournalConfig(keep_finished=5, compact_at_finished=10)) as journal:
        store = SessionStore(journal, resume_ttl_s=60, max_live=8)
        kept = []
        for i in range(300):
            job = Job(prompt=[1, 2, 3], sampling=Sampling(), max_new=2)
            resumable = i % 10 == 0
            await store.open(job, model="mock", kind="chat", stops=[], resumable=resumable)
            await store.commit([(job, [7, 8], [b"a", b"b"])], [(job, "length")])
            job.finish_with("length")
            await store.end(job)            # the request retires
            if resumable:
                kept.append(job.session)
            assert len(store.live) <= 8
            assert not store._decoders
        assert all(not s.resumable or s.job.done for s in store.live.values())
        assert store.live and all(store.live[sid].resumable for sid in store.live)
        assert len(journal.sessions) <= 2 * 5 + 1
        last = journal.sessions[job.session]
        assert last.done and bytes(last.text, "utf-8") == b"ab"
        found = store.lookup(job.session)  # gone from the index, still readable from the log
        assert found is not None and found.job.pieces and b"".join(found.job.pieces) == b"ab"
