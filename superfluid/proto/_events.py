"""The worker-link messages: immutable values with one wire form.

Every message is an ``@attrs.frozen(kw_only=True)`` class with a numeric type
code. On the wire a message is the msgpack array ``[code, {field: value}]``.
Codes ``>= 0x80`` are *droppable* (telemetry): a peer that does not know one
skips it. An unknown *required* code is a :class:`RemoteProtocolError`.

Fields hold only msgpack-native values (ints, floats, str, bytes, lists,
dicts), so ``from_wire(to_wire(m)) == m`` for every message ``m``. A field
added after version 1 is marked ``metadata={"since": 1}``: it goes on the wire
only when it differs from its default, so a peer that predates it reads
every message that does not use it exactly as before.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
import typing
from typing import Any, ClassVar

import attrs
import msgpack

from ._errors import RemoteProtocolError

__all__ = [
    "DROPPABLE_BASE",
    "FAULT_BUG",
    "PROTOCOL_VERSION",
    "TOKENIZED_PIECE",
    "Admit",
    "Admitted",
    "Cancel",
    "EMBEDDED_PIECE_BYTES",
    "Embed",
    "Embedded",
    "Emit",
    "Event",
    "Fault",
    "Hello",
    "HelloAck",
    "Interrupt",
    "LoadFailed",
    "Sampling",
    "SLOT_ACTIONS",
    "SLOT_FILE",
    "Shutdown",
    "SlotAction",
    "SlotDone",
    "Telemetry",
    "Tick",
    "TickDone",
    "Tokenize",
    "Tokenized",
    "from_wire",
    "to_wire",
    "embedded_pieces",
    "tokenized_pieces",
]

PROTOCOL_VERSION = 1
TOKENIZED_PIECE = 1 << 16  # token ids in one Tokenized frame
DROPPABLE_BASE = 0x80
MAX_LOGPROBS = 20
SLOT_ACTIONS = frozenset({"save", "restore", "erase"})   # POST /slots/{id}?action=
SLOT_FILE = re.compile(r"[A-Za-z0-9._-]{1,128}")        # a slot file's name (save, restore): never a path
FINISH_REASONS = frozenset({"eos", "length", "context", "stop", "cancelled", "error"})   # stop: Admit.stops


def _nonneg(_inst: object, attr: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attr.name} must be a non-negative int, got {value!r}")


def _token_list(_inst: object, attr: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
    if value and not (_all_ints(value) and min(value) >= 0):  # C speed; the loop only names the culprit
        for t in value:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"{attr.name} holds a bad token id {t!r}")


def _all_ints(values: Any) -> bool:
    """Every item is a plain int (not a bool), checked at C speed: a prompt's
    ids are checked in tens of milliseconds per million, not a second."""
    return set(map(type, values)) <= {int}


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Event:
    """Base class of all link messages."""

    code: ClassVar[int] = -1


@attrs.frozen(kw_only=True)
class Sampling:
    """Per-lane sampling parameters. ``temperature == 0`` means greedy.

    Seeded sampling is counter-based: the draw for generated token ``k`` uses
    ``(seed, k)``, so a lane resumed after ``k`` tokens draws exactly what the
    uninterrupted lane would have.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=lambda v: tuple(tuple(p) for p in v))
    n_logprobs: int = attrs.field(default=-1)
    grammar: str = ""
    # the request named no temperature (``temperature`` is the default): --spec-max-temperature may
    # lower it on a speculating worker, and never one a request set (on the wire only when true)
    temperature_default: bool = False

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not -1 <= self.n_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"n_logprobs must be in [-1, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        if not self.temperature_default:
            del d["temperature_default"]   # (added after version 1: a peer that predates it reads the rest)
        return d


# ---- daemon -> worker -------------------------------------------------------


@attrs.frozen(kw_only=True)
class Hello(Event):
    """First message on the link: the daemon's supported version range."""

    code: ClassVar[int] = 0x01
    min_version: int = PROTOCOL_VERSION
    max_version: int = PROTOCOL_VERSION


@attrs.frozen(kw_only=True)
class Tokenize(Event):
    """Tokenize ``segments`` (``[text, parse_special]`` pairs) and concatenate.
    Scaffold from a chat template is parsed for special markers; client text
    is not, so a user cannot forge a turn. With ``pieces`` the answer carries
    each id's bytes too; ``ids`` (no segments) asks only for their bytes: a
    detokenize (``/detokenize``, ``/tokenize`` ``with_pieces``)."""

    code: ClassVar[int] = 0x03
    req: int = attrs.field(validator=_nonneg)
    segments: tuple[tuple[str, bool], ...] = attrs.field(converter=lambda v: tuple((str(t), bool(p)) for t, p in v))
    add_special: bool = False
    ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple, validator=_token_list, metadata={"since": 1})
    pieces: bool = attrs.field(default=False, metadata={"since": 1})


@attrs.frozen(kw_only=True)
class Embed(Event):
    """Embed each of ``inputs`` (token ids, one tuple per text): one vector per input,
    pooled the way the worker was started with, scaled to unit length with ``normalize``.
    Answered by :class:`Embedded` pieces."""

    code: ClassVar[int] = 0x10
    req: int = attrs.field(validator=_nonneg)
    inputs: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda v: tuple(tuple(t) for t in v))
    normalize: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("an Embed needs at least one input")
        for tokens in self.inputs:
            if not tokens:
                raise ValueError("an Embed input needs at least one token")
            _token_list(self, attrs.fields(Embed).inputs, tokens)


@attrs.frozen(kw_only=True)
class Admit(Event):
    """Open a lane. ``tokens[:n_prompt]`` is the prompt; any tokens after it were
    generated earlier (a resumed lane) and are prefilled, not re-emitted.
    ``max_new`` caps generated tokens *including* those resumed ones, and the
    sampling counter ``k`` continues from ``len(tokens) - n_prompt``."""

    code: ClassVar[int] = 0x05
    lane: int = attrs.field(validator=_nonneg)
    tokens: tuple[int, ...] = attrs.field(converter=_tuple, validator=_token_list)
    n_prompt: int = attrs.field(validator=_nonneg)
    max_new: int = attrs.field(validator=attrs.validators.ge(1))
    sampling: Sampling = attrs.field(factory=Sampling)
    ignore_eos: bool = False
    priority: int = attrs.field(default=2, validator=_nonneg)   # QoS class: 0 most urgent; orders prefill
    # prefix-cache partition: KV computed under one salt is reused only under the same salt
    cache_salt: str = attrs.field(default="", metadata={"since": 1})
    # stop strings: the lane ends (finish ``stop``) with the token that completes one
    stops: tuple[str, ...] = attrs.field(default=(), converter=tuple, metadata={"since": 1})

    def __attrs_post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a lane needs at least one token")
        if self.n_prompt > len(self.tokens) or self.n_prompt == 0:
            raise ValueError("n_prompt must be in [1, len(tokens)]")


@attrs.frozen(kw_only=True)
class Tick(Event):
    """Run engine steps: prefill up to ``prefill_budget`` tokens and up to
    ``max_rounds`` decode rounds, ending early after ``time_budget_ms`` or on
    :class:`Interrupt`. Each engine step prefills at most about ``step_ms`` of
    measured work, which bounds how long an Interrupt or Cancel waits.
    Answered by exactly one :class:`TickDone`."""

    code: ClassVar[int] = 0x07
    seq: int = attrs.field(validator=_nonneg)
    prefill_budget: int = attrs.field(validator=_nonneg)
    max_rounds: int = attrs.field(validator=_nonneg)
    time_budget_ms: int = attrs.field(validator=_nonneg)
    prefill_lanes: tuple[int, ...] = attrs.field(default=(), converter=_tuple)
    step_ms: int = attrs.field(default=200, validator=_nonneg)


@attrs.frozen(kw_only=True)
class Interrupt(Event):
    """End the running tick at the next engine step (a preemptor is waiting)."""

    code: ClassVar[int] = 0x08


@attrs.frozen(kw_only=True)
class Cancel(Event):
    """Retire a lane. With ``publish`` its KV stays behind as a prefix-cache entry."""

    code: ClassVar[int] = 0x09
    lane: int = attrs.field(validator=_nonneg)
    publish: bool = True


@attrs.frozen(kw_only=True)
class SlotAction(Event):
    """llama-server's slot actions on KV sequence ``seq`` (``POST /slots/{id}``): ``save``
    writes what it holds (a running lane's KV so far, else its cached sequence's) to the park
    directory's ``slots/<filename>``; ``restore`` imports such a file into the free ``seq``
    (checked as a park is: this model, build and KV type, and ``cache_salt``); ``erase``
    drops the free ``seq``'s cached tokens. Answered by exactly one :class:`SlotDone`."""

    code: ClassVar[int] = 0x13
    req: int = attrs.field(validator=_nonneg)
    action: str = attrs.field(validator=attrs.validators.in_(SLOT_ACTIONS))
    seq: int = attrs.field(validator=_nonneg)
    filename: str = ""
    cache_salt: str = ""


@attrs.frozen(kw_only=True)
class Shutdown(Event):
    code: ClassVar[int] = 0x0F


# ---- worker -> daemon -------------------------------------------------------


@attrs.frozen(kw_only=True)
class HelloAck(Event):
    """The worker is loaded and ready: chosen version, runtime, model facts and
    the capability record (each leaf ``True`` or a reason string)."""

    code: ClassVar[int] = 0x02
    version: int = attrs.field(validator=_nonneg)
    runtime: str
    runtime_version: str
    model: dict[str, Any] = attrs.field(factory=dict)
    capabilities: dict[str, Any] = attrs.field(factory=dict)
    limits: dict[str, int] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class LoadFailed(Event):
    code: ClassVar[int] = 0x0A
    message: str


@attrs.frozen(kw_only=True)
class Tokenized(Event):
    """The ids of a ``Tokenize``, in pieces of at most ``TOKENIZED_PIECE`` ids
    (see :func:`tokenized_pieces`): every piece but the last has ``more``."""

    code: ClassVar[int] = 0x04
    req: int = attrs.field(validator=_nonneg)
    tokens: tuple[int, ...] = attrs.field(converter=_tuple, validator=_token_list)
    more: bool = False
    pieces: tuple[bytes, ...] = attrs.field(default=(), converter=_tuple, metadata={"since": 1})  # asked: one per id


def tokenized_pieces(req: int, tokens: list[int], pieces: list[bytes] | None = None) -> list[Tokenized]:
    """The answer to tokenize request ``req``, split so no frame can outgrow the
    link's limit however long the prompt (a msgpack int is at most 9 bytes, so a
    piece is at most ~600 KiB; with each id's bytes, an eighth as many ids), and
    the reader decodes it in bounded steps."""
    n = len(tokens)
    step = TOKENIZED_PIECE if pieces is None else TOKENIZED_PIECE // 8
    starts = range(0, n, step) if n else [0]
    return [Tokenized(req=req, tokens=tokens[i : i + step], more=i + step < n,
                      pieces=() if pieces is None else pieces[i : i + step])
            for i in starts]


@attrs.frozen(kw_only=True)
class Embedded(Event):
    """The vectors of an :class:`Embed`, in input order: each ``dim`` little-endian
    float32 values as bytes. Split in pieces (:func:`embedded_pieces`): every piece but
    the last has ``more``. A non-empty ``error`` (the last piece, no vectors) says why
    the inputs could not be embedded (an input longer than the window, no embedding
    support): the request fails with it."""

    code: ClassVar[int] = 0x11
    req: int = attrs.field(validator=_nonneg)
    dim: int = attrs.field(default=0, validator=_nonneg)
    vectors: tuple[bytes, ...] = attrs.field(default=(), converter=_tuple)
    more: bool = False
    error: str = ""

    def __attrs_post_init__(self) -> None:
        for v in self.vectors:
            if not isinstance(v, bytes) or len(v) != 4 * self.dim:
                raise ValueError(f"an embedding vector must be {self.dim} float32 values")


EMBEDDED_PIECE_BYTES = 4 << 20  # vector bytes in one Embedded frame


def embedded_pieces(req: int, dim: int, vectors: list[bytes]) -> list[Embedded]:
    """The answer to embed request ``req``, split so no frame outgrows the link's limit."""
    per = max(1, EMBEDDED_PIECE_BYTES // max(1, 4 * dim))
    starts = range(0, len(vectors), per) if vectors else [0]
    return [Embedded(req=req, dim=dim, vectors=vectors[i : i + per], more=i + per < len(vectors)) for i in starts]


@attrs.frozen(kw_only=True)
class Admitted(Event):
    """A lane is open; ``cached`` prompt tokens were seeded from the prefix cache; ``seq`` is the
    KV sequence it runs in (``/slots``' slot id; -1 from a worker that predates it)."""

    code: ClassVar[int] = 0x06
    lane: int = attrs.field(validator=_nonneg)
    cached: int = attrs.field(validator=_nonneg)
    seq: int = attrs.field(default=-1, metadata={"since": 1})


def _spec_pair(v: Any) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and x >= 0 for x in v)
            and v[1] <= v[0])


@attrs.frozen(kw_only=True)
class Emit(Event):
    """One engine round's output. ``items`` rows are
    ``[lane, token, piece, finish, logprobs]`` where ``piece`` is the token's
    bytes, ``finish`` is ``None`` or a reason in :data:`FINISH_REASONS`, and
    ``logprobs`` is ``None`` or ``[logprob, [[token, piece, logprob], ...]]``.
    A row with ``token == -1`` carries only a finish (no token). A lane's
    finishing row may carry a sixth field, ``[proposed, accepted]``: the draft
    tokens its speculation proposed and had accepted over the whole lane."""

    code: ClassVar[int] = 0x0B
    items: tuple[tuple[Any, ...], ...] = attrs.field(converter=lambda v: tuple(map(tuple, v)))

    def __attrs_post_init__(self) -> None:
        for row in self.items:
            if len(row) != 5 and not (len(row) == 6 and row[3] is not None and _spec_pair(row[5])):
                raise ValueError("an emit row has five fields (six on a drafting lane's finish)")
            lane, token, piece, finish, _lp = row[:5]
            if not isinstance(lane, int) or lane < 0 or not isinstance(token, int) or token < -1:
                raise ValueError(f"bad emit row {row!r}")
            if not isinstance(piece, bytes):
                raise ValueError("emit piece must be bytes")
            if finish is not None and finish not in FINISH_REASONS:
                raise ValueError(f"unknown finish reason {finish!r}")


@attrs.frozen(kw_only=True)
class TickDone(Event):
    code: ClassVar[int] = 0x0C
    seq: int = attrs.field(validator=_nonneg)
    rounds: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_ms: float = 0.0
    interrupted: bool = False
    prefill_left: dict[int, int] = attrs.field(factory=dict)
    kv_used: int = 0
    kv_total: int = 0
    aborted: int = 0      # prefill passes stopped midway for a more urgent arrival
    # speculation, when it runs: cumulative ``proposed``/``accepted``/``rounds``/``plain_rounds``,
    # ``abandoned``, and ``counts`` {lanes: [verdict, speedup]} (worker/_spec.py ``Gates.snapshot``)
    spec: dict[str, Any] = attrs.field(factory=dict, metadata={"since": 1})
    # --park, when on: cumulative ``parks``/``resumes``/``resume_tokens``/``restore_s``/``evicted``,
    # ``fallbacks`` {reason: n}, and the directory's ``bytes`` and ``artifacts`` now (worker/_park.py)
    park: dict[str, Any] = attrs.field(factory=dict, metadata={"since": 1})


@attrs.frozen(kw_only=True)
class Fault(Event):
    """A lane (or, with ``lane == -1``, the engine) failed; the lane is closed.
    ``kind`` :data:`FAULT_BUG` is the injected fault (tests, the fuzzer): the
    daemon's loop raises on it as it would on a bug of its own."""

    code: ClassVar[int] = 0x0D
    lane: int = -1
    kind: str = "engine"
    message: str = ""


@attrs.frozen(kw_only=True)
class SlotDone(Event):
    """The answer to a :class:`SlotAction`: the tokens saved, restored or erased and the
    file's bytes; or ``status`` (an HTTP status: 400, 404, 409, 501) and ``error`` (a
    typed code) with ``message``."""

    code: ClassVar[int] = 0x14
    req: int = attrs.field(validator=_nonneg)
    tokens: int = attrs.field(default=0, validator=_nonneg)
    nbytes: int = attrs.field(default=0, validator=_nonneg)
    status: int = attrs.field(default=0, validator=_nonneg)
    error: str = ""
    message: str = ""


FAULT_BUG = "bug"


@attrs.frozen(kw_only=True)
class Telemetry(Event):
    """Droppable: engine counters for /metrics. Safe to lose."""

    code: ClassVar[int] = DROPPABLE_BASE + 0x01
    values: dict[str, float] = attrs.field(factory=dict)


_CLASSES: tuple[type[Event], ...] = (
    Hello, Tokenize, Admit, Tick, Interrupt, Cancel, Shutdown, Embed, SlotAction,
    HelloAck, LoadFailed, Tokenized, Admitted, Emit, TickDone, Fault, Telemetry, Embedded, SlotDone,
)
assert len({cls.code for cls in _CLASSES}) == len(_CLASSES), "two link messages share a code"
_REGISTRY: dict[int, type[Event]] = {
    cls.code: cls
    for cls in _CLASSES
}
_HINTS: dict[type[Any], dict[str, Any]] = {
    cls: typing.get_type_hints(cls) for cls in (*_REGISTRY.values(), Sampling)
}
_FIELDS: dict[type[Event], tuple[str, ...]] = {
    cls: tuple(f.name for f in attrs.fields(cls)) for cls in _REGISTRY.values()
}
_LATER: dict[type[Event], dict[str, Any]] = {  # fields sent only when not their default
    cls: {f.name: f.default for f in attrs.fields(cls) if "since" in f.metadata} for cls in _REGISTRY.values()
}


def _type_ok(value: Any, ann: Any) -> bool:
    """Does a decoded msgpack value match a field annotation (the forms used here)?"""
    return _checker(ann)(value)


_CHECKERS: dict[Any, Callable[[Any], bool]] = {}


def _checker(ann: Any) -> Callable[[Any], bool]:
    """The check of one annotation, built once: every worker frame is checked field by field,
    and an ``Emit`` carries a row per token (reading the annotation on each row was a tenth of
    the daemon's time at 256 streams)."""
    check = _CHECKERS.get(ann)
    if check is None:
        check = _CHECKERS[ann] = _build_checker(ann)
    return check


def _is_seq(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _build_checker(ann: Any) -> Callable[[Any], bool]:
    if ann is Any:
        return lambda _v: True
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(a) for a in args]
        return lambda v: any(c(v) for c in options)
    if ann is type(None):
        return lambda v: v is None
    if ann is bool:
        return lambda v: isinstance(v, bool)
    if ann is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if ann is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if ann in (str, bytes, Sampling):
        return lambda v: isinstance(v, ann)
    if origin is dict:
        kc, vc = _checker(args[0]), _checker(args[1])
        return lambda v: isinstance(v, dict) and all(kc(k) and vc(x) for k, x in v.items())
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = args[0]
            if item is int:  # token ids
                return lambda v: _is_seq(v) and _all_ints(v)
            if item is Any:
                return _is_seq
            if typing.get_origin(item) is tuple and typing.get_args(item) == (Any, ...):
                # rows (an Emit's): sequences of anything, checked at C speed
                return lambda v: _is_seq(v) and set(map(type, v)) <= {list, tuple}
            ic = _checker(item)
            return lambda v: _is_seq(v) and all(map(ic, v))
        parts = [_checker(a) for a in args]
        return lambda v: _is_seq(v) and len(v) == len(parts) and all(c(x) for c, x in zip(parts, v, strict=True))
    return lambda _v: False


def _check_types(cls: type[Event], payload: dict[str, Any]) -> None:
    hints = _HINTS[cls]
    for name, value in payload.items():
        if not _type_ok(value, hints[name]):
            raise RemoteProtocolError(f"invalid {cls.__name__}: field {name} has the wrong type ({value!r:.60})")


def to_wire(event: Event) -> bytes:
    payload: dict[str, Any] = {}
    later = _LATER[type(event)]
    for name in _FIELDS[type(event)]:
        value = getattr(event, name)
        if name in later and value == later[name]:
            continue
        payload[name] = value.to_dict() if isinstance(value, Sampling) else value
    return msgpack.packb([event.code, payload], use_bin_type=True)


def from_wire(body: bytes, *, max_len: int) -> Event | None:
    """Decode one frame body. Returns ``None`` for an unknown droppable message.

    Raises:
        RemoteProtocolError: anything but a well-formed known message.
    """
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            max_bin_len=max_len,
            max_str_len=max_len,
            max_array_len=max_len,
            max_map_len=max_len,
            max_ext_len=0,
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types; all mean "bad bytes"
        raise RemoteProtocolError(f"undecodable frame: {exc}") from None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], dict)):
        raise RemoteProtocolError("a frame must be [code, {fields}]")
    code, payload = obj
    cls = _REGISTRY.get(code)
    if cls is None:
        if code >= DROPPABLE_BASE:
            return None
        raise RemoteProtocolError(f"unknown required message type {code:#x}")
    allowed = _FIELDS[cls]
    if any(not isinstance(k, str) or k not in allowed for k in payload):
        raise RemoteProtocolError(f"unexpected fields in {cls.__name__}: {sorted(map(str, payload))}")
    try:
        if cls is Admit and "sampling" in payload:
            s = payload["sampling"]
            if not isinstance(s, dict) or any(k not in _HINTS[Sampling] for k in s):
                raise TypeError("sampling must be a map of sampling fields")
            for name, value in s.items():
                if not _type_ok(value, _HINTS[Sampling][name]):
                    raise TypeError(f"sampling.{name} has the wrong type")
            payload = {**payload, "sampling": Sampling(**s)}
        _check_types(cls, payload)
        return cls(**payload)
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"invalid {cls.__name__}: {exc}") from None
