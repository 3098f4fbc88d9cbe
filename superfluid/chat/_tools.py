"""Tool calling on the text side: prompts, wires, parsing, grammars, recovery.

One module because the pieces share one contract: whatever the model writes,
a client sees either content or parsed calls, never a half-parsed wire.

- **Prompts.** A model whose template knows tools renders them itself. A
  ChatML model without one (SmolLM2, the mock) gets a curated Hermes prompt
  (:func:`render_chatml`), rendered append-stably so each turn of an agent loop
  extends the previous prompt byte for byte. Client text (content, tool
  schemas, call arguments) is always a non-special segment.
- **Wires** (:class:`ToolWire`, learned from the template text): Hermes/Qwen
  ``<tool_call>{json}</tool_call>`` (also Qwen3.5's ``<function=f>`` body),
  Llama 3 bare JSON / ``<|python_tag|>``, Mistral ``[TOOL_CALLS]``, Gemma
  ``call:f{k:v}``.
- **Parsing.** :class:`ToolCallParser` streams content and holds back only
  what could still be a call marker. A malformed call is repaired when that is
  safe (fences, prose, trailing commas, an unterminated tail) and otherwise
  returned as text: never dropped, never invented.
- **Forced calls.** ``tool_choice`` required/named becomes a JSON schema for
  the call document (:func:`call_schema`) that the worker compiles; the reply
  is that document. A reply cut by ``max_tokens`` is closed to the smallest
  schema-valid document (:func:`close_json`), so its
  arguments parse; the caller keeps ``finish_reason: length``.

The JSON repair and the schema closer live in :mod:`._jsonclose`.
"""

from __future__ import annotations

import json
import re
import secrets
from enum import Enum
from typing import Any, Literal

import attrs

from ._jsonclose import close_json, repair_json
from ._reasoning import ReasoningSplitter, partial_marker

__all__ = [
    "Delta", "ForcedCallParser", "ReplyParser", "Tool", "ToolCall", "ToolCallParser", "ToolChoice", "ToolWire",
    "call_markers", "call_schema", "close_json", "detect_wire", "flatten_tool_messages", "forced_prefill", "new_call_id",
    "parse_call_body", "render_chatml", "repair_json", "template_knows_tools",
]


# --- values -------------------------------------------------------------------------------------------------

@attrs.frozen
class Tool:
    """A declared function tool, dialect-neutral."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@attrs.frozen
class ToolChoice:
    """``auto`` (default), ``none``, ``required`` or ``named`` (with ``name``)."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str = ""

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@attrs.frozen
class ToolCall:
    """A parsed call. ``arguments`` is the JSON text of an object.

    ``recovered`` marks a call whose document was closed by truncation
    recovery: shape-valid, not the model's finished intent.
    """

    id: str
    name: str
    arguments: str
    recovered: bool = False

    @property
    def input(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}


@attrs.frozen
class Delta:
    """Released reply text on one channel."""

    channel: Literal["content", "reasoning"]
    text: str


Event = Delta | ToolCall


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --- wires and prompts ---------------------------------------------------------------------------------------

class ToolWire(Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    GEMMA = "gemma"


# (open marker, close marker or None = until the end of the reply)
_MARKERS: dict[ToolWire, tuple[tuple[str, str | None], ...]] = {
    ToolWire.HERMES: (("<tool_call>", "</tool_call>"),),
    ToolWire.LLAMA3: (("<|python_tag|>", None),),
    ToolWire.MISTRAL: (("[TOOL_CALLS]", None),),
    ToolWire.GEMMA: (("<|tool_call>", "<tool_call|>"), ("<start_function_call>", "<end_function_call>")),
}
_BARE_JSON = {ToolWire.HERMES, ToolWire.LLAMA3}


def detect_wire(template_source: str) -> ToolWire:
    """The call wire a chat template teaches (Hermes when it teaches none)."""
    if "[TOOL_CALLS]" in template_source:
        return ToolWire.MISTRAL
    if "<|tool_call>" in template_source or "<start_function_call>" in template_source:
        return ToolWire.GEMMA
    if "<|python_tag|>" in template_source or ("ipython" in template_source and "parameters" in template_source):
        return ToolWire.LLAMA3
    return ToolWire.HERMES


def template_knows_tools(template_source: str) -> bool:
    """Whether a template renders ``tools`` and assistant ``tool_calls`` itself."""
    return "tools" in template_source and "tool_call" in template_source


def call_markers(wire: ToolWire) -> list[str]:
    """The markers that open a call on ``wire`` (stop strings when calls are not allowed)."""
    return [open_marker for open_marker, _ in _MARKERS[wire]]


def forced_prefill(wire: ToolWire) -> str:
    """Scaffold appended after the generation prompt when a call is forced."""
    return {ToolWire.HERMES: "<tool_call>\n", ToolWire.MISTRAL: "[TOOL_CALLS]"}.get(wire, "")


_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _tool_lines(tools: list[Tool]) -> str:
    return "".join("\n" + json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return '{"name": ' + json.dumps(fn.get("name", ""), ensure_ascii=False) + ', "arguments": ' + (args or "{}") + "}"


def render_chatml(messages: list[dict[str, Any]], tools: list[Tool], *,
                  add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
    """The curated ChatML tool prompt, as ``(text, parse_special)`` segments.

    Append-stable: rendering a conversation, then the same conversation with
    the assistant's reply and further turns appended, yields the first as a
    byte prefix of the second (up to the generation prompt), so agent loops
    reuse the prefix cache every turn. Tool results are grouped into one user
    turn of ``<tool_response>`` blocks (Qwen2.5 style).
    """
    segs: list[tuple[str, bool]] = []
    rest = list(messages)
    system = rest.pop(0)["content"] if rest and rest[0]["role"] == "system" else None
    if system is not None or tools:
        segs.append(("<|im_start|>system\n", True))
        if system:
            segs.append((system + ("\n\n" if tools else ""), False))
        if tools:
            segs += [(_TOOLS_HEAD, True), (_tool_lines(tools), False), (_TOOLS_TAIL, True)]
        segs.append(("<|im_end|>\n", True))
    i = 0
    while i < len(rest):
        m = rest[i]
        role = m["role"]
        if role == "tool":
            segs.append(("<|im_start|>user", True))
            while i < len(rest) and rest[i]["role"] == "tool":
                segs += [("\n<tool_response>\n", True), (rest[i].get("content") or "", False),
                         ("\n</tool_response>", True)]
                i += 1
            segs.append(("<|im_end|>\n", True))
            continue
        segs += [(f"<|im_start|>{role}\n", True), (m.get("content") or "", False)]
        for k, call in enumerate(m.get("tool_calls") or ()):
            sep = "\n" if (k or m.get("content")) else ""
            segs += [(sep + "<tool_call>\n", True), (_call_text(call), False), ("\n</tool_call>", True)]
        segs.append(("<|im_end|>\n", True))
        i += 1
    if add_generation_prompt:
        segs.append(("<|im_start|>assistant\n", True))
    return [s for s in segs if s[0]]


def flatten_tool_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """Tool turns as plain text, for a template that knows no tools (non-ChatML).

    The tool prompt joins the system message; calls and results become
    ``<tool_call>`` / ``<tool_response>`` text inside ordinary turns.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            text = "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool": True})
            continue
        content = m.get("content") or ""
        calls = ["<tool_call>\n" + _call_text(c) + "\n</tool_call>" for c in m.get("tool_calls") or ()]
        out.append({"role": m["role"], "content": "\n".join(([content] if content else []) + calls)})
    for m in out:
        m.pop("_tool", None)
    if tools:
        prompt = _TOOLS_HEAD + _tool_lines(tools) + _TOOLS_TAIL
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def call_schema(tools: list[Tool], choice: ToolChoice, *, args_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call document for a forced ``tool_choice``.

    Raises:
        ValueError: a named choice that is not declared, or no tools.
    """
    if choice.mode == "named":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the declared tools")
    else:
        chosen = list(tools)
    if not chosen:
        raise ValueError("tool_choice requires a call but no tools are declared")
    branches = [{"type": "object", "properties": {"name": {"const": t.name}, args_key: t.parameters or {"type": "object"}},
                 "required": ["name", args_key], "additionalProperties": False} for t in chosen]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


# --- call bodies ---------------------------------------------------------------------------------------------

_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\[ARGS\]")
_XML_FN = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|$)", re.S)
_GEMMA_CALL = re.compile(r"\s*call:([A-Za-z_][\w.\-]*)\s*(\{.*\})\s*$", re.S)
_GEMMA_STR = '<|"|>'


def _typed(value: str, schema: Any) -> Any:
    """A raw argument typed from its schema: a ``string`` stays a string."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _gemma_args(text: str, props: dict[str, Any]) -> dict[str, Any]:
    """``{k:<|"|>v<|"|>,n:3}`` (Gemma's call syntax) as a JSON object."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith(_GEMMA_STR, i):
            j = text.find(_GEMMA_STR, i + len(_GEMMA_STR))
            if j < 0:
                raise ValueError("unterminated string")
            out.append(json.dumps(text[i + len(_GEMMA_STR):j]))
            i = j + len(_GEMMA_STR)
            continue
        m = re.match(r"[A-Za-z_][\w\-]*", text[i:])
        if m and text[i + m.end():].lstrip().startswith(":") and (not out or out[-1] in "{,"):
            out.append(json.dumps(m.group()))
            i += m.end()
            continue
        if m and m.group() not in ("true", "false", "null"):
            out.append(json.dumps(m.group()))
            i += m.end()
            continue
        out.append(text[i])
        i += 1
    value = json.loads("".join(out))
    if not isinstance(value, dict):
        raise ValueError("arguments are not an object")
    out_args: dict[str, Any] = {}
    for k, v in value.items():
        kind = props.get(k, {}).get("type") if isinstance(props.get(k), dict) else None
        if kind == "string" and not isinstance(v, str):
            v = json.dumps(v)  # a raw 8080 under a string schema stays the string "8080"
        out_args[k] = v
    return out_args


def _as_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict[str, Any]]:
    if not isinstance(obj, dict):
        raise ValueError("a call is not an object")
    fn = obj.get("function")
    if isinstance(fn, dict):
        obj = fn
    name = obj.get("name", fn if isinstance(fn, str) else None)
    if not isinstance(name, str) or not name:
        raise ValueError("a call has no name")
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        args = repair_json(args) if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError("call arguments are not an object")
    return name, args


def parse_call_body(body: str, wire: ToolWire, tools: list[Tool]) -> list[tuple[str, dict[str, Any]]]:
    """The calls in one marked (or bare) call body.

    Raises:
        ValueError: the body is not a call that can be safely repaired, or it
            names an undeclared tool.
    """
    props = {t.name: (t.parameters or {}).get("properties", {}) for t in tools}
    calls: list[tuple[str, dict[str, Any]]] = []
    text = body.strip()
    if wire is ToolWire.GEMMA:
        m = _GEMMA_CALL.match(text)
        if not m:
            raise ValueError("not a call:NAME{...} body")
        calls.append((m.group(1), _gemma_args(m.group(2), props.get(m.group(1), {}))))
    elif text.startswith("<function="):
        for fm in _XML_FN.finditer(text):
            p = props.get(fm.group(1), {})
            calls.append((fm.group(1), {k: _typed(v, p.get(k)) for k, v in _XML_PARAM.findall(fm.group(2))}))
    elif wire is ToolWire.MISTRAL and _MISTRAL_ARGS.match(text):
        pos = 0
        while (m := _MISTRAL_ARGS.match(text, pos)) is not None:
            args, end = json.JSONDecoder().raw_decode(text, m.end())
            calls.append(_as_call({"name": m.group(1), "arguments": args}))
            pos = end
    else:
        text = text.removeprefix("<|python_tag|>")
        objs: list[Any] = []
        value = repair_json(text)
        objs = value if isinstance(value, list) else [value]
        if wire is ToolWire.LLAMA3 and isinstance(value, dict) and ";" in text:
            objs = [repair_json(part) for part in text.split(";") if part.strip()]
        calls = [_as_call(o) for o in objs]
    if not calls:
        raise ValueError("no call in the body")
    names = set(props)
    for name, _ in calls:
        if names and name not in names:
            raise ValueError(f"the model called {name!r}, which is not a declared tool")
    return calls


# --- streaming parser ----------------------------------------------------------------------------------------

def _could_start_bare(compact: str) -> bool | None:
    """True: a bare JSON call starts here; None: undecided; False: prose."""
    for head in ('{"name"', '{"function"'):
        if compact.startswith(head):
            return True
        if head.startswith(compact):
            return None
    return False


@attrs.define
class ToolCallParser:
    """Separates content from tool calls in streamed reply text.

    :meth:`feed` returns events safe to emit now; :meth:`finish` flushes.
    Content is released as soon as it cannot be part of a call marker; a call
    is emitted whole when its close marker arrives (or at the end for wires
    that run to the end of the reply). Whitespace around calls is dropped.
    """

    wire: ToolWire
    tools: list[Tool]
    calls: list[ToolCall] = attrs.field(factory=list, init=False)
    _state: str = attrs.field(default="start", init=False)
    _buf: str = attrs.field(default="", init=False)
    _ws: str = attrs.field(default="", init=False)
    _marker: tuple[str, str | None] = attrs.field(default=("", None), init=False)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        out = self._drain(final=True)
        if self._state in ("call", "bare"):
            out += self._close_call(self._buf, self._marker[0] if self._state == "call" else "", "")
            self._buf = ""
        if self._ws and not self.calls:
            out.append(Delta("content", self._ws))
        self._ws = ""
        return out

    def _content(self, text: str) -> list[Event]:
        head = text.rstrip()
        if not head:
            self._ws += text
            return []
        out = [Delta("content", self._ws + head)] if (self._ws or head) else []
        self._ws = text[len(head):]
        return out

    def _close_call(self, body: str, open_marker: str, close_marker: str) -> list[Event]:
        try:
            parsed = parse_call_body(body, self.wire, self.tools)
        except (ValueError, RecursionError):
            return self._content(open_marker + body + close_marker)  # returned as text, never dropped
        out: list[Event] = []
        for name, args in parsed:
            call = ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))
            self.calls.append(call)
            out.append(call)
        return out

    def _drain(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        markers = _MARKERS[self.wire]
        while True:
            buf = self._buf
            if self._state == "start":
                compact = re.sub(r"\s+", "", buf)
                bare = _could_start_bare(compact) if self.wire in _BARE_JSON else False
                if bare is None and not final:
                    return out
                self._state = "bare" if bare else "text"
                continue
            if self._state == "text":
                hits = [(buf.find(o), o, c) for o, c in markers if buf.find(o) >= 0]
                if hits:
                    at, o, c = min(hits)
                    out += self._content(buf[:at])
                    self._buf, self._state, self._marker = buf[at + len(o):], "call", (o, c)
                    continue
                hold = 0 if final else max(partial_marker(buf, o) for o, _ in markers)
                out += self._content(buf[: len(buf) - hold])
                self._buf = buf[len(buf) - hold:]
                return out
            if self._state == "call":
                o, c = self._marker
                at = buf.find(c) if c else -1
                if at < 0:
                    return out  # the body is held until the close marker (or the end)
                out += self._close_call(buf[:at], o, c or "")
                self._buf, self._state = buf[at + len(c or ""):], "text"
                continue
            return out  # bare: held until finish


@attrs.define
class ForcedCallParser:
    """The reply is one call document constrained by :func:`call_schema`."""

    schema: dict[str, Any]
    tools: list[Tool]
    args_key: str = "arguments"
    calls: list[ToolCall] = attrs.field(factory=list, init=False)
    _buf: str = attrs.field(default="", init=False)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return []

    def finish(self) -> list[Event]:
        text, recovered = self._buf, False
        if not text.strip():
            return []  # the model never started the document: nothing is invented
        try:
            doc = json.loads(text)
        except ValueError:
            suffix = close_json(text, self.schema)
            if suffix is None:
                return [Delta("content", text)]
            doc, recovered = json.loads(text + suffix), True
        try:
            name, args = _as_call(doc, (self.args_key,))
        except ValueError:
            return [Delta("content", text)]
        call = ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False), recovered)
        self.calls.append(call)
        return [call]


@attrs.define
class ReplyParser:
    """Reasoning split, then tool parsing: released text in, typed events out."""

    reasoning: ReasoningSplitter | None = None
    tools: ToolCallParser | ForcedCallParser | None = None

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str) -> list[Event]:
        pieces = self.reasoning.feed(text) if self.reasoning else [("content", text)]
        return self._route(pieces)

    def finish(self) -> list[Event]:
        out = self._route(self.reasoning.finish()) if self.reasoning else []
        if self.tools is not None:
            out += self.tools.finish()
        return out

    def _route(self, pieces: list[tuple[str, str]]) -> list[Event]:
        out: list[Event] = []
        for channel, text in pieces:
            if channel == "reasoning":
                out.append(Delta("reasoning", text))
            elif self.tools is not None:
                out += self.tools.feed(text)
            elif text:
                out.append(Delta("content", text))
        return out
