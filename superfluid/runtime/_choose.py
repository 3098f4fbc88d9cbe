"""Choosing the runtime, the install and the worker command for a model (``serve``,
``POST /v1/models/load``, ``superfluid runtimes MODEL``)."""

from __future__ import annotations

from dataclasses import dataclass

from ._registry import RuntimeInfo, UnknownRuntime, get, mismatch, resolve
from ._status import RuntimeUnavailable, worker_command

__all__ = ["Choice", "RuntimeRefused", "choose", "split_selector"]


class RuntimeRefused(Exception):
    """The model cannot be served as asked; the message is one line that says what to do.
    ``install``: the runtime id whose ``runtime install`` would fix it (serve may install it)."""

    def __init__(self, message: str, *, install: str | None = None) -> None:
        super().__init__(message)
        self.install = install


@dataclass(frozen=True)
class Choice:
    info: RuntimeInfo
    install: str | None
    worker: tuple[str, ...]


def split_selector(selector: str | None) -> tuple[str | None, str | None]:
    """``ID[@INSTALL]`` -> (id, install); ``auto`` and None -> (None, None)."""
    if not selector or selector.lower() == "auto":
        return None, None
    rid, _, install = selector.partition("@")
    return rid, install or None


def choose(spec: str, selector: str | None) -> Choice:
    """The runtime (``selector`` = ``ID[@INSTALL]``, else by the model's format), checked
    against the model's format and against what is installed, before anything loads.

    Raises:
        RuntimeRefused: an unknown runtime, a format mismatch, or a runtime that cannot run here.
    """
    rid, install = split_selector(selector)
    try:
        info = resolve(spec, rid)
    except UnknownRuntime as exc:
        raise RuntimeRefused(str(exc)) from None
    why = mismatch(info, spec)
    if why is not None:
        raise RuntimeRefused(why)
    try:
        worker = worker_command(info.id, install)
    except RuntimeUnavailable as exc:
        raise RuntimeRefused(str(exc), install=info.id if exc.installable and install is None else None) from None
    return Choice(info, install, worker)


def _selector_refusal(selector: str | None) -> str | None:
    """Why ``selector`` (``ID[@INSTALL]``) names no runtime, or None; reads no file."""
    rid, _install = split_selector(selector)
    if rid is None:
        return None
    try:
        get(rid)
    except UnknownRuntime as exc:
        return str(exc)
    return None


def _runtime_refusal(spec: str, selector: str | None) -> str | None:
    try:
        choose(spec, selector)
    except RuntimeRefused as exc:
        return str(exc)
    return None
