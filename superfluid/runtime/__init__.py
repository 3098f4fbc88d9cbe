"""Runtimes: the registry of what superfluid can run (``_registry``), and their installs
under ``$SUPERFLUID_HOME/runtimes/`` (``_home``, ``_install``, ``_status``).

Importing this package imports only the registry (the worker process reads it)."""

from __future__ import annotations

from ._registry import RUNTIMES, RuntimeInfo, UnknownRuntime, detect, detect_format, get, mismatch, resolve

__all__ = ["RUNTIMES", "RuntimeInfo", "UnknownRuntime", "detect", "detect_format", "get", "mismatch", "resolve"]
