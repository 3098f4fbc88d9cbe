"""Field checks shared by the session-log event bodies (``_wal.py`` and
``_wal_conversation.py``): each returns the canonical value or raises
``ValueError`` naming the field."""

from __future__ import annotations

import array
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["MAX_INT", "MAX_TOKEN_ID", "error_field", "int_field", "map_field", "opt_str", "plain", "reason", "tenant_field",
           "tokens"]

MAX_INT: Final = 2**63 - 1
MAX_TOKEN_ID: Final = 2**32 - 1  # token arrays are stored as u32 in memory


def int_field(name: str, value: object, *, hi: int = MAX_INT) -> int:
    if type(value) is not int or not 0 <= value <= hi:
        raise ValueError(f"{name} must be an int in [0, {hi}], got {value!r}")
    return value


def tokens(value: object) -> list[int]:
    if not isinstance(value, (list, tuple, range, array.array)):
        raise ValueError(f"tokens must be a list of token ids, got {type(value).__name__}")
    try:
        # array('I') checks type and range in C: ints in [0, 2**32); it also
        # turns bools into plain ints, which is the canonical form.
        return array.array("I", value).tolist()
    except (TypeError, OverflowError):
        raise ValueError(f"tokens must be ints in [0, {MAX_TOKEN_ID}]") from None


def opt_str(name: str, value: object) -> str | None:
    if value is not None and type(value) is not str:
        raise ValueError(f"{name} must be a string or None, got {type(value).__name__}")
    return value


def reason(name: str, value: object) -> str:
    if type(value) is not str or not 0 < len(value) <= 64:
        raise ValueError(f"{name} must be a non-empty string of at most 64 characters, got {value!r}")
    return value


def plain(value: object, depth: int = 0) -> object:
    """A msgpack-native copy with tuples as lists, so a decoded body compares
    equal to the one that was encoded."""
    if depth > 32:
        raise ValueError("nesting too deep")
    if type(value) is int and not -(2**63) <= value < 2**64:
        raise ValueError(f"{value} does not fit in 64 bits")
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, Mapping):
        if not all(type(k) is str for k in value):
            raise ValueError("map keys must be strings")
        return {k: plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    raise ValueError(f"{type(value).__name__} is not a msgpack-native value")


def map_field(name: str, value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a map")
    out = plain(value)
    assert isinstance(out, dict)
    return out


def error_field(name: str, value: object) -> object:
    """An error: a string, a map, or None."""
    if value is None or type(value) is str:
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a string, a map or None")
    return plain(value)


def tenant_field(name: str, value: object) -> dict[str, str]:
    """``{"tenant": value}``, or ``{}`` for the tenant "" (absent in the log)."""
    if value is None or value == "":
        return {}
    if type(value) is not str or len(value) > 256:
        raise ValueError(f"{name} must be a string of at most 256 characters")
    return {"tenant": value}
