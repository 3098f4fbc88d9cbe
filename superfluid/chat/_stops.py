"""Turning committed token pieces into client text: incremental UTF-8 and
stop strings held back until they can no longer become a stop."""

from __future__ import annotations

import codecs

__all__ = ["StopScan", "TextStream"]


class TextStream:
    """Stop strings are looked for only in the text not yet released (at most
    the longest stop's length plus one token's text), never in the whole reply."""

    def __init__(self, stops: list[str] | tuple[str, ...] = (), *, keep: bool = True) -> None:
        self.stops = [s for s in stops if s]
        self._keep = keep             # False: released text is not kept (:class:`StopScan` only asks where a stop is)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""          # decoded text not yet released (could start a stop)
        self._parts: list[str] = []  # released text, joined on demand (``+=`` copied the reply per token)
        self.stopped = False

    @property
    def text(self) -> str:
        """The text released so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text now safe to release."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        return self._release(final=False)

    def feed_many(self, pieces: list[bytes]) -> str:
        """``"".join(feed(p) for p in pieces)``; with no stop strings, one decode for all of them."""
        if self.stops or self.stopped:
            return "".join([self.feed(p) for p in pieces])
        out = self._decoder.decode(b"".join(pieces))
        if out:
            self._parts.append(out)
        return out

    def finish(self) -> str:
        """Flush at the end of generation (nothing can become a stop any more)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        buf = self._pending
        if self.stops:
            cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self._pending = ""
                if self._keep:
                    self._parts.append(buf[:cut])
                return buf[:cut]
        hold = 0
        if not final:
            for s in self.stops:
                for n in range(min(len(s) - 1, len(buf)), 0, -1):
                    if buf.endswith(s[:n]):
                        hold = max(hold, n)
                        break
        out = buf[: len(buf) - hold]
        self._pending = buf[len(buf) - hold :]
        if out and self._keep:
            self._parts.append(out)
        return out


class StopScan:
    """Whether a stop string is complete, one token's bytes at a time, decoded
    exactly as a reader's :class:`TextStream` decodes them: the scheduler ends a
    lane at the token that completes a stop (``sched/_core.py``), so what a reply
    counts does not depend on when its reader looked. Keeps only the text that
    could still begin a stop."""

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self._text = TextStream(stops, keep=False)

    def feed(self, piece: bytes) -> bool:
        """Add one token's bytes; True once a stop string is complete (and from then on)."""
        self._text.feed(piece)
        return self._text.stopped
