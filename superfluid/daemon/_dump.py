"""``SIGUSR2``: the daemon logs where every task waits, beside each model's
``Scheduler.describe()`` (one block, at WARNING so it shows under any ``--log-level``).
For a request that never ends: find its handler's task and read what it awaits."""

from __future__ import annotations

import os
from types import FrameType
from typing import Any

import trio


def _frames(coro: Any) -> list[FrameType]:
    """The frames of a coroutine and of everything it awaits, outermost first."""
    out: list[FrameType] = []
    seen = 0
    while coro is not None and seen < 64:
        seen += 1
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            out.append(frame)
        coro = (getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
                or getattr(coro, "gi_yieldfrom", None))
    return out


def _where(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    short = path[path.rfind("superfluid" + os.sep):] if "superfluid" + os.sep in path else os.path.basename(path)
    return f"{frame.f_code.co_name}@{short}:{frame.f_lineno}"


def _job_of(frame: FrameType) -> str:
    job = frame.f_locals.get("job")
    return f"[job {job.id}]" if job is not None and hasattr(job, "id") else ""


def task_tree() -> list[str]:
    """One line per task: indented by depth, its name, then its await chain."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        if len(lines) >= 2000:
            return
        frames = _frames(task.coro)
        ours = [i for i, f in enumerate(frames) if f"superfluid{os.sep}" in f.f_code.co_filename]
        # our frames, then the first library frame below them (what it waits in)
        keep = frames[ours[0]:ours[-1] + 2] if ours else frames[-3:]
        chain = " > ".join(_where(f) + _job_of(f) for f in keep)
        lines.append(f"{'  ' * depth}{task.name.rsplit('.', 1)[-1]}: {chain}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    return lines

