"""The session journal: the write-ahead token log (``<sessions>/wal.log``),
its replay into per-session state, group commit and compaction.

The record format and event bodies are pure protocol code in
:mod:`superfluid.proto` (``_wal.py``); this package does the file I/O."""

from __future__ import annotations

from ._errors import JournalClosed as JournalClosed
from ._errors import JournalError as JournalError
from ._errors import JournalLocked as JournalLocked
from ._errors import JournalWriteError as JournalWriteError
from ._errors import SessionStateError as SessionStateError
from ._errors import WalCorrupt as WalCorrupt
from ._journal import Journal as Journal
from ._journal import JournalConfig as JournalConfig
from ._journal import JournalStatistics as JournalStatistics
from ._journal import open_journal as open_journal
from ._sessionlog import SessionLog as SessionLog
