"""Fuzz the pure request validators.

Invariant: on any JSON request object, ``sampling_from``, ``stops_from`` and
``parse_messages`` either return a well-formed value or raise ``ApiError``
with a 4xx status -- never another exception (which would be a 500).

The bodies are what ``read_json`` hands over: a JSON *object* (anything else is
refused there with a 400), round-tripped through ``json`` so they hold exactly
what ``json.loads`` can produce, including NaN, Infinity and integers with
hundreds of digits.

Budget: ``SUPERFLUID_FUZZ_EXAMPLES`` examples per test (default 200).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from superfluid.api._http import ApiError
from superfluid.api._chat import parse_messages
from superfluid.api._params import sampling_from, stops_from
from superfluid.proto import Sampling

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("SUPERFLUID_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- JSON ---------------------------------------------------------------------------------

json_numbers = st.one_of(
    st.integers(),
    # json.loads makes ints of any size (up to 4300 digits); hypothesis rarely draws them
    st.builds(lambda n, sign: sign * 10**n + n, st.integers(0, 1000), st.sampled_from([1, -1])),
    st.floats(allow_nan=True, allow_infinity=True),  # json.loads accepts NaN and Infinity
    st.sampled_from([0, 1, -1, 0.0, -0.0, 0.5, 1e308, 2**63, 2**64]),
)
json_scalars = st.one_of(st.none(), st.booleans(), json_numbers, st.text(max_size=16))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)

token_keys = st.one_of(
    st.integers(-5, 70_000).map(str),
    st.sampled_from(["", " 1", "1 ", "+1", "1_0", "0x10", "1.0", "1e3", "\u0661", "-0", "99999999999999999999"]),
    st.text(max_size=6),
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "", "USER"]) | st.text(max_size=6)
content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10) | json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "image", "input_image", "video"])}),
    st.dictionaries(st.sampled_from(["type", "text"]) | st.text(max_size=5), json_values, max_size=3),
    json_values,
)
messages = st.one_of(
    st.fixed_dictionaries(
        {"role": roles}, optional={"content": st.text(max_size=20) | st.lists(content_parts, max_size=3) | json_values,
                                   "name": json_values, "tool_calls": json_values},
    ),
    json_values,
)

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": json_numbers,
    "top_p": json_numbers,
    "top_k": json_numbers,
    "min_p": json_numbers,
    "seed": json_numbers,
    "repeat_penalty": json_numbers,
    "repetition_penalty": json_numbers,
    "presence_penalty": json_numbers,
    "frequency_penalty": json_numbers,
    "logit_bias": st.dictionaries(token_keys, json_numbers, max_size=4),
    "stop": st.text(max_size=8) | st.lists(st.text(max_size=4), max_size=20),
    "messages": st.lists(messages, max_size=4),
}


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True)):
        body[key] = draw(FIELDS[key] | json_values)  # the expected shape, or anything
    body.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3)))
    return json.loads(json.dumps(body))  # exactly what the server would decode


def refused_or(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)``, or None if it raised ApiError with a 4xx status."""
    try:
        return fn(*args, **kw)
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc
        assert exc.message
        return None


# ---- the validators -------------------------------------------------------------------------


@FUZZ
@given(body=bodies(), n_vocab=st.integers(1, 200_000), want_logprobs=st.integers(-1, 20))
@example(body={"logit_bias": {"1": 10**400}}, n_vocab=100, want_logprobs=-1)  # OverflowError in float(v)
@example(body={"logit_bias": {"1": float("nan")}}, n_vocab=100, want_logprobs=-1)
@example(body={"temperature": float("nan"), "seed": 2**64}, n_vocab=100, want_logprobs=-1)
def test_fuzz_sampling_from(body: dict[str, Any], n_vocab: int, want_logprobs: int) -> None:
    sampling = refused_or(sampling_from, body, n_vocab=n_vocab, want_logprobs=want_logprobs)
    if sampling is not None:
        assert isinstance(sampling, Sampling)
        assert 0.0 <= sampling.temperature <= 5.0
        assert 0 <= sampling.seed < 2**32
        assert sampling.n_logprobs == want_logprobs
        for tok, bias in sampling.logit_bias:
            assert 0 <= tok < n_vocab
            assert -100.0 <= bias <= 100.0


@FUZZ
@given(body=bodies())
def test_fuzz_stops_from(body: dict[str, Any]) -> None:
    stops = refused_or(stops_from, body)
    if stops is not None:
        assert isinstance(stops, list) and all(isinstance(s, str) for s in stops)
        assert len(stops) <= 16


@FUZZ
@given(body=bodies())
@example(body={"messages": [{"role": "user", "content": [{"type": ["text"]}]}]})
def test_fuzz_parse_messages(body: dict[str, Any]) -> None:
    parsed = refused_or(parse_messages, body)
    if parsed is not None:
        assert parsed
        for m in parsed:
            assert m["role"] in ("system", "user", "assistant", "tool")
            assert isinstance(m["content"], str)
