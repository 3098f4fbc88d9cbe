"""Typed ``argparse`` values for numeric flags: each checks its rule at parse time.

Every numeric option of every subcommand takes its ``type=`` from here, so a value that
means nothing (``--prefill-budget 0`` hangs every request, ``--max-batch 0`` would become
one lane) is a one-line usage error (exit 2) before anything starts. Each parser carries
its rule as ``.rule``; tests/test_cli_flags.py walks every parser and refuses a numeric
option whose type has none, so a new flag cannot skip the check.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

__all__ = ["fraction", "in_range", "nonneg_float", "nonneg_int", "port", "positive_float", "positive_int"]


def _number(kind: type[int] | type[float], value: str) -> Any:
    number = kind(value)  # a ValueError reads "invalid int value: 'x'" (argparse, by parse.__name__)
    if kind is float and not math.isfinite(number):  # nan passes no comparison, inf every upper bound
        raise argparse.ArgumentTypeError(f"expected a finite number, got {value!r}")
    return number


def _checked(kind: type[int] | type[float], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        number = _number(kind, value)
        if not ok(number):
            raise argparse.ArgumentTypeError(f"{rule}, got {value!r}")
        return number

    parse.rule = rule  # type: ignore[attr-defined]
    parse.__name__ = kind.__name__  # argparse names the type in "invalid <name> value" messages
    return parse


positive_int = _checked(int, lambda n: n > 0, "must be 1 or more")
nonneg_int = _checked(int, lambda n: n >= 0, "must be 0 or more")
positive_float = _checked(float, lambda n: n > 0, "must be more than 0")
nonneg_float = _checked(float, lambda n: n >= 0, "must be 0 or more")
fraction = _checked(float, lambda n: 0 < n <= 1, "must be a fraction in (0, 1]")
kv_bits = _checked(int, lambda n: n in (16, 8), "must be 16 or 8")
port = _checked(int, lambda n: 0 <= n <= 65535, "must be a TCP port, 0 to 65535 (0: any free port)")


def in_range(kind: type[int] | type[float], low: float, high: float) -> Callable[[str], Any]:
    """A ``kind`` in ``[low, high]``."""
    return _checked(kind, lambda n: low <= n <= high, f"must be in [{low:g}, {high:g}]")
