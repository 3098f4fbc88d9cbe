"""Ending a worker process: the escalation ladder, and the environment it starts with.

This is the one module that sends signals to processes.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping

import trio

__all__ = ["CREDENTIAL_RE", "HUGE_PAGES_TUNABLE", "graceful_kill", "kill_now", "scrub_env", "worker_env"]

# *_TOKEN, *_KEY (API, access, private, signing... keys), *_CREDENTIALS, and anything naming a
# password or a secret (SUPERFLUID_API_KEY included)
CREDENTIAL_RE = re.compile(r"((^|_)(TOKEN|API_?KEY|KEY|CREDENTIALS?)$)|PASSWORD|PASSWD|SECRET", re.I)


# glibc's malloc asks for transparent huge pages (madvise) on the memory it maps: the runtime's KV
# cache and compute buffers then sit in 2 MiB pages instead of scattered 4 KiB ones. Measured on
# Gemma 3 270M, 12,000-token prefill: 2-5% faster in each of five fresh-process pairs, and less at
# the mercy of where a process's pages happen to land (docs/benchmarks.md, session 21). A no-op
# where THP is "never" and outside glibc.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def scrub_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Everything but credential-named variables."""
    return {k: v for k, v in environ.items() if not CREDENTIAL_RE.search(k)}


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for a worker: ``environ`` without credentials, unbuffered, and with
    malloc's huge pages on unless the operator's ``GLIBC_TUNABLES`` already says
    ``glibc.malloc.hugetlb`` (``=0`` turns it off)."""
    env = scrub_env(environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    tunables = env.get("GLIBC_TUNABLES", "")
    if not any(t.split("=", 1)[0] == "glibc.malloc.hugetlb" for t in tunables.split(":")):
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE
    return env


def kill_now(process: trio.Process) -> None:
    if process.returncode is None:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def graceful_kill(process: trio.Process, *, grace_s: float, term_s: float) -> None:
    """``deliver_cancel`` for workers. Workers share the daemon's process group
    (so killing the daemon's group kills them), hence signals go to the worker
    process itself, never its group. The daemon has already asked the worker to
    shut down over the link (or it is unresponsive); give it ``grace_s`` to
    exit, then SIGTERM, then after ``term_s`` SIGKILL. The caller (``run_process``)
    always reaps the process afterwards.

    Cancellation: runs shielded inside ``run_process``; its total time is bounded
    by ``grace_s + term_s``.
    """
    with trio.move_on_after(grace_s):
        await process.wait()
        return
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(term_s):
        await process.wait()
        return
    kill_now(process)
