"""The ``superfluid`` command line: ``serve`` and the commands around it."""

from __future__ import annotations

from ._main import main

__all__ = ["main"]
