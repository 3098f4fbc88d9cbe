"""Exception groups, read the one way: what a nursery's group holds.

Every place that turns a nursery's :class:`BaseExceptionGroup` back into one failure (a worker
that died, a model's supervisor, a request's error, an install, the command line) uses these, so
"which failure is the failure" has one answer."""

from __future__ import annotations

__all__ = ["first_leaf", "leaves"]


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc`` (itself, when it is no group), nested groups flattened in order."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    return [leaf for inner in exc.exceptions for leaf in leaves(inner)]


def first_leaf(exc: BaseException) -> BaseException:
    """The first exception inside ``exc`` (itself, when it is no group)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]  # a group is never empty
    return exc
