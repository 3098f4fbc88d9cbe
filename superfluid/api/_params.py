"""Validation of generation parameters shared by every dialect."""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any

from ..chat import TEMPLATE_NAMES
from ..proto import Sampling
from ._http import ApiError

__all__ = ["check_loggable", "integer", "number", "sampling_from", "stops_from", "template_kwargs_from"]

MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
LOG_DEPTH = 32                       # the session log's nesting limit (proto/_wal_fields.py ``plain``)
LOG_INTS = range(-(2**63), 2**64)    # the integers its msgpack records hold


def _finite(value: float) -> bool:
    return isinstance(value, int) or math.isfinite(value)


def number(body: dict[str, Any], key: str, *, lo: float, hi: float, default: float | None = None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ApiError(400, f"invalid request: {key} must be a finite number", param=key)
    if not lo <= value <= hi:
        raise ApiError(400, f"invalid request: {key} must be between {lo:g} and {hi:g}", param=key)
    return float(value)


def integer(body: dict[str, Any], key: str, *, lo: int, hi: int, default: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"invalid request: {key} must be an integer", param=key)
    if not lo <= value <= hi:
        raise ApiError(400, f"invalid request: {key} must be between {lo} and {hi}", param=key)
    return value


def stops_from(body: dict[str, Any], key: str = "stop") -> list[str]:
    stop = body.get(key)
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS
            and all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)):
        raise ApiError(400, f"invalid request: {key} must be a string or an array of at most {MAX_STOPS} strings "
                            f"of at most {MAX_STOP_CHARS} characters", param=key)
    return [s for s in stops if s]


def template_kwargs_from(body: dict[str, Any], key: str = "chat_template_kwargs") -> dict[str, Any]:
    """Client variables for the chat template: an object of at most
    :data:`MAX_TEMPLATE_KWARGS` identifier keys, none shadowing a template
    variable, whose JSON is at most :data:`MAX_TEMPLATE_KWARGS_BYTES`."""
    kwargs = body.get(key)
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, f"invalid request: {key} must be an object", param=key)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ApiError(400, f"invalid request: {key} has more than {MAX_TEMPLATE_KWARGS} entries", param=key)
    for name in kwargs:
        if _IDENTIFIER.fullmatch(name) is None:
            raise ApiError(400, f"invalid request: {key} key {name[:80]!r} is not an identifier", param=key)
        if name in TEMPLATE_NAMES:
            raise ApiError(400, f"invalid request: {key}.{name} would shadow the template's own variable",
                           param=f"{key}.{name}")
    if len(json.dumps(kwargs, ensure_ascii=False).encode()) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ApiError(400, f"invalid request: {key} is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON",
                       param=key)
    return kwargs


def check_loggable(value: Any, param: str, *, depth: int = LOG_DEPTH) -> None:
    """Refuse a client value that a session-log record cannot hold: an integer
    outside 64 bits, or nesting more than ``depth`` levels below ``value``. The
    log would raise as the record is written (a 500); here it is the client's 400.

    Raises:
        ApiError: 400 naming the first such path (iteratively: ``value`` may be deep).
    """
    stack: list[tuple[str, Any, int]] = [(param, value, 0)]
    while stack:
        path, v, level = stack.pop()
        shown = path if len(path) <= 200 else f"{path[:200]}…"
        if level > depth:
            raise ApiError(400, f"invalid request: {shown} is nested more than {depth} levels deep "
                                "(the session log's limit)", param=param)
        if type(v) is int and v not in LOG_INTS:
            raise ApiError(400, f"invalid request: {shown} is an integer that does not fit in 64 bits",
                           param=shown)
        if isinstance(v, dict):
            stack += [(f"{path}.{k}", x, level + 1) for k, x in reversed(v.items())]
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x, level + 1) for i, x in reversed(list(enumerate(v)))]


def _logit_bias(body: dict[str, Any], n_vocab: int) -> list[tuple[int, float]]:
    raw = body.get("logit_bias")
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise ApiError(400, "invalid request: logit_bias must be an object", param="logit_bias")
    if len(raw) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"invalid request: logit_bias has more than {MAX_LOGIT_BIAS} entries", param="logit_bias")
    bias: list[tuple[int, float]] = []
    for k, v in raw.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10) or not int(k) < n_vocab:
            raise ApiError(400, f"invalid request: logit_bias key {k[:40]!r} is not a token id of this model "
                                f"(0 to {n_vocab - 1})", param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or (
                isinstance(v, int) and v not in LOG_INTS):  # (a conversation's turn logs the value as sent)
            raise ApiError(400, f"invalid request: logit_bias[{k}] must be a finite number (an integer within "
                                "64 bits)", param="logit_bias")
        bias.append((int(k), float(max(-100, min(100, v)))))
    return bias


def sampling_from(body: dict[str, Any], *, n_vocab: int, want_logprobs: int = -1) -> Sampling:
    temperature = number(body, "temperature", lo=0.0, hi=5.0, default=1.0)
    seed = integer(body, "seed", lo=0, hi=2**64 - 1)
    repeat_key = "repetition_penalty" if body.get("repeat_penalty") is None else "repeat_penalty"
    return Sampling(
        temperature=temperature or 0.0,
        temperature_default=body.get("temperature") is None,
        top_p=number(body, "top_p", lo=0.0, hi=1.0, default=1.0) or 0.0,
        top_k=integer(body, "top_k", lo=0, hi=1_000_000, default=0) or 0,
        min_p=number(body, "min_p", lo=0.0, hi=1.0, default=0.0) or 0.0,
        repeat_penalty=number(body, repeat_key, lo=0.0, hi=10.0, default=1.0) or 1.0,
        presence_penalty=number(body, "presence_penalty", lo=-2.0, hi=2.0, default=0.0) or 0.0,
        frequency_penalty=number(body, "frequency_penalty", lo=-2.0, hi=2.0, default=0.0) or 0.0,
        seed=secrets.randbits(32) if seed is None else seed % 2**32,
        logit_bias=_logit_bias(body, n_vocab),
        n_logprobs=want_logprobs,
    )
