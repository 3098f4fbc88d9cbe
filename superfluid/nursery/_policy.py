"""Restart policy as data (after OTP supervisors: intensity within a window)."""

from __future__ import annotations

from enum import Enum

import attrs

from .. import _defaults as D

__all__ = ["RestartKind", "RestartPolicy", "RestartTracker"]


class RestartKind(Enum):
    PERMANENT = "permanent"   # always restart
    TRANSIENT = "transient"   # restart only after an abnormal exit
    TEMPORARY = "temporary"   # never restart


@attrs.frozen(kw_only=True)
class RestartPolicy:
    kind: RestartKind = RestartKind.PERMANENT
    max_restarts: int = D.MAX_RESTARTS
    window_s: float = D.RESTART_WINDOW_S
    backoff_s: float = 0.25
    max_backoff_s: float = 5.0  # a worker that cannot even be spawned is retried at doubling delays up to this

    def spawn_backoff(self, failures: int) -> float:
        """The wait before the next spawn after ``failures`` (>= 1) spawns in a row failed."""
        return min(self.backoff_s * 2 ** (failures - 1), self.max_backoff_s)


@attrs.define
class RestartTracker:
    """Counts restarts inside the policy window. Time is passed in (``now``)."""

    policy: RestartPolicy
    _times: list[float] = attrs.field(factory=list)

    def allow(self, now: float, *, abnormal: bool = True) -> bool:
        """Record a restart attempt at ``now``; False when the intensity is exceeded."""
        if self.policy.kind is RestartKind.TEMPORARY:
            return False
        if self.policy.kind is RestartKind.TRANSIENT and not abnormal:
            return False
        self._times = [t for t in self._times if now - t < self.policy.window_s]
        if len(self._times) >= self.policy.max_restarts:
            return False
        self._times.append(now)
        return True

    def reset(self) -> None:
        self._times.clear()
