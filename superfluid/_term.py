"""Terminal pieces shared by the monitor in ``serve`` and ``superfluid top``.

A full-screen view (rich's ``Live`` on the alternate screen, refreshed only when
the caller says so, never by a thread of its own), keys read without blocking
trio (cbreak mode on the tty, ``trio.lowlevel.wait_readable`` on its fd), and a
text sparkline. Whatever way the view ends (a key, a signal, cancellation, an
exception), the terminal gets back its modes, its cursor and its normal screen.
"""

from __future__ import annotations

import contextlib
import os
import sys
import termios
import tty
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

import trio
from rich.console import Console, RenderableType
from rich.live import Live

__all__ = ["Screen", "cbreak", "read_keys", "sparkline"]

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
    """The alternate screen, redrawn by :meth:`show`. A context manager that restores
    the normal screen and the cursor when it ends."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._live = Live(console=self.console, screen=True, auto_refresh=False, transient=True,
                          redirect_stdout=False, redirect_stderr=False)

    def __enter__(self) -> Screen:
        self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.stop()

    def show(self, renderable: RenderableType) -> None:
        self._live.update(renderable, refresh=True)

    @property
    def size(self) -> tuple[int, int]:
        return self.console.size.width, self.console.size.height
