"""Terminal pieces shared by the monitor in ``serve`` and ``superfluid top``.

A full-screen view (the alternate screen, redrawn row by row where a frame changed,
only when the caller says so, never by a thread of its own), keys read without blocking
trio (cbreak mode on the tty, ``trio.lowlevel.wait_readable`` on its fd), and a
text sparkline. Whatever way the view ends (a key, a signal, cancellation, an
exception), the terminal gets back its modes, its cursor and its normal screen.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import termios
import tty
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

import trio
from rich.color import ColorSystem
from rich.console import Console, RenderableType
from rich.style import Style
from rich.text import Text

__all__ = ["Screen", "ansi_rows", "cbreak", "read_keys", "sparkline"]

_BARS = "▁▂▃▄▅▆▇█"
QUIT_KEYS = frozenset({"q", "Q", "\x1b"})  # a lone Esc; an arrow key's sequence is longer


def sparkline(values: Iterable[float], width: int) -> str:
    """The last ``width`` values as bars scaled to their maximum (blank when all are 0)."""
    tail = list(values)[-width:]
    top = max(tail, default=0.0)
    if top <= 0:
        return " " * len(tail)
    return "".join(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1) + 0.5))] if v > 0 else " "
                   for v in tail)


@contextlib.contextmanager
def cbreak(stream: TextIO | None = None) -> Iterator[int | None]:
    """Put the terminal on ``stream`` (stdin) in cbreak mode: keys arrive one by one,
    unechoed; Ctrl-C still signals. Yields its fd, or None if it is not a terminal.
    The old modes come back on every exit."""
    stream = stream or sys.stdin
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, OSError):
        yield None
        return
    if not os.isatty(fd):
        yield None
        return
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


async def read_keys(fd: int | None, on_key: Callable[[str], bool]) -> None:
    """Hand each key typed on ``fd`` to ``on_key`` until it returns True or input ends.
    With no terminal (``fd`` None) it waits until cancelled. A read happens only when
    the fd is readable, so it never blocks the event loop."""
    if fd is None:
        await trio.sleep_forever()
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            continue
        if not data:
            await trio.sleep_forever()  # input closed: only a signal or cancellation ends us now
        text = data.decode(errors="replace")
        if text == "\x1b":
            if on_key(text):
                return
            continue
        for key in text.replace("\x1b", ""):
            if on_key(key):
                return


class Screen:
    """The alternate screen, redrawn by :meth:`show`: only the rows that changed since the
    last frame are written (a steady monitor rewrites a few rows a second, not the whole
    screen; the terminal's parse and redraw run on the cores the engine uses). A context
    manager that restores the normal screen and the cursor when it ends."""

    def __init__(self, console: Console | None = None, out: TextIO | None = None) -> None:
        self.console = console or Console()
        self.out = out or self.console.file
        self._rows: list[str] = []
        self._size = (0, 0)

    def __enter__(self) -> Screen:
        self._write("\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J")
        return self

    def __exit__(self, *exc: object) -> None:
        self._write("\x1b[0m\x1b[?25h\x1b[?1049l")

    def _write(self, data: str) -> None:
        try:
            self.out.write(data)
            self.out.flush()
        except (OSError, ValueError):
            pass  # the terminal went away: nothing left to draw on

    def show(self, renderable: RenderableType) -> None:
        width, height = self.size
        if (width, height) != self._size:  # resized: everything is drawn again
            self._size, self._rows = (width, height), []
            self._write("\x1b[H\x1b[2J")
        color = self.console.color_system is not None and not self.console.no_color
        rows = (ansi_rows(renderable, width, height, color=color) if isinstance(renderable, Text)
                else self._rich_rows(renderable, width, height, color=color))
        rows += [""] * (height - len(rows))
        out = []
        for i, row in enumerate(rows):
            if i >= len(self._rows) or self._rows[i] != row:
                out.append(f"\x1b[{i + 1};1H\x1b[0m{row}\x1b[0m\x1b[K")
        self._rows = rows
        if out:
            self._write("".join(out))

    def _rich_rows(self, renderable: RenderableType, width: int, height: int, *, color: bool) -> list[str]:
        options = self.console.options.update(width=width, height=height, no_wrap=True)
        lines = self.console.render_lines(renderable, options, pad=False)
        system = ColorSystem.STANDARD if color else None
        return ["".join(seg.style.render(seg.text, color_system=system) if seg.style else seg.text
                        for seg in line if not seg.control) for line in lines[:height]]

    @property
    def size(self) -> tuple[int, int]:
        return self.console.size.width, self.console.size.height


@functools.lru_cache(maxsize=64)
def _codes(style: str) -> tuple[str, str]:
    """The escape that starts ``style`` (a rich style string) and the one that ends it."""
    start = Style.parse(style).render("\x00", color_system=ColorSystem.STANDARD).partition("\x00")[0] if style else ""
    return start, "\x1b[0m" if start else ""


def ansi_rows(text: Text, width: int, height: int, *, color: bool = True) -> list[str]:
    """``text``'s first ``height`` lines cropped to ``width`` columns, as escape-coded rows:
    a few string operations per styled piece, where rich's layout of a whole screen cost
    ~3-4 ms a frame. Assumes single-column characters and spans that do not overlap (as
    the monitor writes them)."""
    plain = text.plain
    spans = sorted((sp.start, sp.end, str(sp.style)) for sp in text.spans if sp.end > sp.start)
    rows: list[str] = []
    start = 0
    k = 0
    for line in plain.split("\n")[:height]:
        end = start + min(len(line), max(0, width - 1))
        parts: list[str] = []
        pos = start
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        j = k
        while j < len(spans) and spans[j][0] < end:
            s0, s1, style = spans[j]
            s0, s1 = max(s0, pos), min(s1, end)
            if s0 > pos:
                parts.append(plain[pos:s0])
            if s1 > s0:
                on, off = _codes(style) if color else ("", "")
                parts.append(f"{on}{plain[s0:s1]}{off}")
                pos = s1
            j += 1
        if end > pos:
            parts.append(plain[pos:end])
        rows.append("".join(parts))
        start += len(line) + 1
    return rows
