"""Showing a pull: a progress bar (bytes, rate, ETA) on a terminal, one line per file otherwise."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

import trio

if TYPE_CHECKING:
    from ..models._hub import PullProgress

__all__ = ["show_progress"]


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


async def show_progress(what: str, progress: PullProgress, *, stream: TextIO | None = None,
                        interval: float = 0.1) -> None:
    """Render ``progress`` until cancelled (the caller cancels it when the pull ends,
    then the last state is drawn)."""
    out = stream or sys.stderr
    if out.isatty():
        await _bar(what, progress, out, interval)
    else:
        await _lines(what, progress, out, interval)


async def _lines(what: str, progress: PullProgress, out: TextIO, interval: float) -> None:
    shown = 0
    waiting = False
    try:
        while True:
            if progress.status.startswith("waiting") and not waiting:
                waiting = True
                print(f"{what}: {progress.status}", file=out, flush=True)
            shown = _print_finished(what, progress, out, shown)
            await trio.sleep(interval)
    finally:
        _print_finished(what, progress, out, shown)


def _print_finished(what: str, progress: PullProgress, out: TextIO, shown: int) -> int:
    for name, size, resumed, seconds in progress.finished[shown:]:
        if seconds == 0.0 and resumed == size:
            note = "already in the cache"
        else:
            rate = (size - resumed) / seconds if seconds > 0 else 0.0
            note = f"{seconds:.1f} s, {_mb(rate)}/s" + (f", resumed at {_mb(resumed)}" if resumed else "")
        print(f"{what}: {name} {_mb(size)} ({note})", file=out, flush=True)
    return len(progress.finished)


async def _bar(what: str, progress: PullProgress, out: TextIO, interval: float) -> None:
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    console = Console(file=out)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=console, auto_refresh=False, transient=False)
    tasks: dict[int, int] = {}

    def draw() -> None:
        i = progress.index
        if i and i not in tasks:
            label = progress.file.rpartition("/")[2]
            if progress.count > 1:
                label += f" [{i}/{progress.count}]"
            tasks[i] = bar.add_task(label, total=progress.total or None, completed=progress.resumed_from)
        if i:
            bar.update(tasks[i], total=progress.total or None, completed=progress.completed)
        for done in range(1, i):
            t = bar.tasks[tasks[done]] if done in tasks else None
            if t is not None and t.total is not None and t.completed < t.total:
                bar.update(tasks[done], completed=t.total)
        bar.refresh()

    waiting = False
    with bar:
        console.print(f"pulling {what}")
        try:
            while True:
                if progress.status.startswith("waiting") and not waiting:
                    waiting = True
                    console.print(f"{what}: {progress.status}")
                draw()
                await trio.sleep(interval)
        finally:
            draw()

