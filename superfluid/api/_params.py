"""Validation of generation parameters shared by every dialect."""

from __future__ import annotations

import secrets
from typing import Any

from ..proto import Sampling
from ._http import ApiError

__all__ = ["number", "integer", "sampling_from", "stops_from"]


def number(body: dict[str, Any], key: str, *, lo: float, hi: float, default: float | None = None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"invalid request: {key} must be a number", param=key)
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


def stops_from(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return [s for s in stop if s]
    raise ApiError(400, "invalid request: stop must be a string or an array of at most 16 strings", param="stop")


def sampling_from(body: dict[str, Any], *, n_vocab: int, want_logprobs: int = -1) -> Sampling:
    temperature = number(body, "temperature", lo=0.0, hi=5.0, default=1.0)
    seed = integer(body, "seed", lo=-(2**63), hi=2**64 - 1)
    bias_raw = body.get("logit_bias") or {}
    if not isinstance(bias_raw, dict):
        raise ApiError(400, "invalid request: logit_bias must be an object", param="logit_bias")
    bias: list[tuple[int, float]] = []
    for k, v in bias_raw.items():
        try:
            tok = int(k)
        except ValueError:
            raise ApiError(400, f"invalid request: logit_bias key {k!r} is not a token id", param="logit_bias") from None
        if not 0 <= tok < n_vocab or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ApiError(400, f"invalid request: logit_bias entry {k!r} is out of range", param="logit_bias")
        bias.append((tok, float(max(-100, min(100, v)))))
    repeat = body.get("repeat_penalty", body.get("repetition_penalty"))
    return Sampling(
        temperature=temperature or 0.0,
        top_p=number(body, "top_p", lo=0.0, hi=1.0, default=1.0) or 0.0,
        top_k=integer(body, "top_k", lo=0, hi=1_000_000, default=0) or 0,
        min_p=number(body, "min_p", lo=0.0, hi=1.0, default=0.0) or 0.0,
        repeat_penalty=number({"r": repeat}, "r", lo=0.0, hi=10.0, default=1.0) or 1.0,
        presence_penalty=number(body, "presence_penalty", lo=-2.0, hi=2.0, default=0.0) or 0.0,
        frequency_penalty=number(body, "frequency_penalty", lo=-2.0, hi=2.0, default=0.0) or 0.0,
        seed=(seed % 2**32) if seed else secrets.randbits(31) + 1,
        logit_bias=bias,
        n_logprobs=want_logprobs,
    )
