"""Ending a worker process: the escalation ladder, and the environment it starts with.

This is the one module that sends signals to processes.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping

import trio

__all__ = ["CREDENTIAL_RE", "graceful_kill", "kill_now", "scrub_env"]

# *_TOKEN, *_KEY (API, access, private, signing... keys), *_CREDENTIALS, and anything naming a
# password or a secret (SUPERFLUID_API_KEY included)
CREDENTIAL_RE = re.compile(r"((^|_)(TOKEN|API_?KEY|KEY|CREDENTIALS?)$)|PASSWORD|PASSWD|SECRET", re.I)


def scrub_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for a worker: everything but credential-named variables."""
    return {k: v for k, v in environ.items() if not CREDENTIAL_RE.search(k)}


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
