"""What a job is, without how it is waited for: its state, its typed failure and its
prefix-cache partition. Pure (no trio), so the scheduler core can use them."""

from __future__ import annotations

import hashlib
import json
from enum import Enum

import attrs

__all__ = ["JobError", "JobState", "cache_partition"]


class JobState(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


def cache_partition(tenant: str, cache_salt: str) -> str:
    """The prefix-cache partition of a job: KV computed under one partition is
    never reused under another. "" (no keys, no ``cache_salt``) is the one
    partition of a keyless daemon; otherwise a digest, so the worker never
    sees tenant names or salts."""
    if not tenant and not cache_salt:
        return ""
    return hashlib.sha256(json.dumps([tenant, cache_salt]).encode()).hexdigest()[:32]


@attrs.frozen(kw_only=True)
class JobError:
    """A typed failure, ready to become an HTTP error or an SSE error frame."""

    status: int
    message: str
    type: str = "server_error"
    code: str | None = None

    @classmethod
    def log_failed(cls, exc: BaseException) -> JobError:
        """The session log could not take a request's records: 507 ``insufficient_storage``
        when the disk is full (``exc.out_of_space``), else 503 ``session_log_failed``."""
        if getattr(exc, "out_of_space", False):
            return cls(status=507, code="insufficient_storage",
                       message=f"the disk holding the session log is full; nothing is generated until it has "
                               f"room again: {exc}")
        return cls(status=503, code="session_log_failed", message=f"the session log could not be written: {exc}")
