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

Size: the JSON repair and schema closer (the section "JSON repair and
forced-truncation recovery") are self-contained and belong in their own
``_jsonclose.py``; they live here only until that split is made.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from enum import Enum
from typing import Any, Literal

import attrs

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


# --- JSON repair and forced-truncation recovery ----------------------------------------------------------------

_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*|\s*```$")


def _fix_tail(s: str) -> str:
    """Drop trailing commas and close an unterminated tail (string-aware)."""
    out: list[str] = []
    stack: list[str] = []
    in_str = esc = False
    for ch in s:
        if in_str:
            out.append(ch)
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            while out and out[-1] in " \t\r\n,":
                out.pop()
            if not stack:
                break
            stack.pop()
            out.append(ch)
            if not stack:
                break
            continue
        out.append(ch)
    if in_str:
        if esc:
            out.pop()
        out.append('"')
    text = "".join(out).rstrip().rstrip(",").rstrip()
    if stack and stack[-1] == "}":
        if text.endswith(":"):
            text += "null"
        elif text.endswith('"') and re.search(r'[{,]\s*"(?:[^"\\]|\\.)*"$', text):
            text += ":null"
    return text + "".join(reversed(stack))


def repair_json(text: str) -> Any:
    """Parse JSON a model wrote, repairing only what is safe to repair.

    Strips markdown fences and prose around the value, drops trailing commas,
    closes an unterminated tail.

    Raises:
        ValueError: no JSON value can be recovered.
    """
    t = _FENCE.sub("", text.strip())
    try:
        return json.loads(t)
    except ValueError:
        pass
    starts = [i for i in (t.find("{"), t.find("[")) if i >= 0]
    if not starts:
        raise ValueError("no JSON value in the text")
    t = t[min(starts):]
    try:
        return json.JSONDecoder().raw_decode(t)[0]
    except ValueError:
        pass
    return json.JSONDecoder().raw_decode(_fix_tail(t))[0]


_NUMBER = re.compile(r"-?\d*(\.\d*)?([eE][-+]?\d*)?")


def _in_bounds(value: float, s: dict[str, Any], *, integer: bool) -> bool:
    if integer and not float(value).is_integer():
        return False
    num = (int, float)
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    return not ((isinstance(lo, num) and value < lo) or (isinstance(hi, num) and value > hi)
                or (isinstance(xlo, num) and value <= xlo) or (isinstance(xhi, num) and value >= xhi))


class _Mismatch(Exception):
    """The text cannot be a prefix of a document valid under the schema."""


_WS = " \t\r\n"


@attrs.define
class _Closer:
    """Recursive descent over a document prefix under a JSON schema.

    Each ``_value`` call returns ``None`` when it consumed a complete value, or
    the suffix that closes the value when the text ended inside it.
    """

    text: str
    root: dict[str, Any]
    pos: int = 0

    def _resolve(self, schema: Any) -> dict[str, Any]:
        for _ in range(32):
            if schema is True or not isinstance(schema, dict):
                return {}
            ref = schema.get("$ref")
            if not isinstance(ref, str) or not ref.startswith("#/"):
                break
            node: Any = self.root
            for part in ref[2:].split("/"):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            schema = {**{k: v for k, v in schema.items() if k != "$ref"}, **node}
        if "allOf" in schema and isinstance(schema["allOf"], list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self._resolve(part)
                merged.setdefault("properties", {}).update(part.get("properties", {}))
                merged["required"] = [*merged.get("required", []), *part.get("required", [])]
                merged.update({k: v for k, v in part.items() if k not in ("properties", "required")})
            schema = merged
        return schema

    def _ws(self) -> bool:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1
        return self.pos >= len(self.text)

    def minimal(self, schema: Any) -> str:
        """The smallest document valid under ``schema`` (Runner's choice of values)."""
        s = self._resolve(schema)
        if "const" in s:
            return json.dumps(s["const"], ensure_ascii=False)
        if isinstance(s.get("enum"), list) and s["enum"]:
            return json.dumps(s["enum"][0], ensure_ascii=False)
        branches = s.get("anyOf") or s.get("oneOf")
        if isinstance(branches, list) and branches:
            nulls = [b for b in branches if self._resolve(b).get("type") == "null"]
            return self.minimal((nulls or branches)[0])
        kind = s.get("type")
        if isinstance(kind, list):
            kind = "null" if "null" in kind else (kind[0] if kind else None)
        if kind is None:
            kind = "object" if "properties" in s else ("array" if "items" in s else "null")
        if kind == "boolean":
            return "false"
        if kind in ("integer", "number"):
            value = 0
            num = (int, float)
            if isinstance(s.get("minimum"), num) and value < s["minimum"]:
                value = math.ceil(s["minimum"])
            if isinstance(s.get("exclusiveMinimum"), num) and value <= s["exclusiveMinimum"]:
                value = math.floor(s["exclusiveMinimum"]) + 1
            if isinstance(s.get("maximum"), num) and value > s["maximum"]:
                value = math.floor(s["maximum"])
            if isinstance(s.get("exclusiveMaximum"), num) and value >= s["exclusiveMaximum"]:
                value = math.ceil(s["exclusiveMaximum"]) - 1
            return str(value)
        if kind == "string":
            return json.dumps("x" * int(s.get("minLength", 0)))
        if kind == "array":
            return "[" + ",".join(self.minimal(self._item(s, i)) for i in range(int(s.get("minItems", 0)))) + "]"
        if kind == "object":
            props = s.get("properties", {})
            return "{" + ",".join(json.dumps(k) + ":" + self.minimal(props.get(k, {}))
                                  for k in s.get("required", [])) + "}"
        return "null"

    @staticmethod
    def _item(s: dict[str, Any], i: int) -> Any:
        prefix = s.get("prefixItems")
        if isinstance(prefix, list) and i < len(prefix):
            return prefix[i]
        items = s.get("items", {})
        return items if isinstance(items, dict) else {}

    def value(self, schema: Any) -> str | None:
        s = self._resolve(schema)
        if self._ws():
            return self.minimal(s)
        branches = s.get("anyOf") or s.get("oneOf")
        if isinstance(branches, list) and branches:
            start = self.pos
            for branch in branches:
                self.pos = start
                try:
                    return self.value(branch)
                except _Mismatch:
                    continue
            raise _Mismatch("no branch of anyOf fits")
        ch = self.text[self.pos]
        kinds = s.get("type")
        kinds = set(kinds) if isinstance(kinds, list) else ({kinds} if isinstance(kinds, str) else None)
        kind = {"{": "object", "[": "array", '"': "string", "t": "boolean", "f": "boolean", "n": "null"}.get(
            ch, "number" if ch in "-0123456789" else "")
        if not kind:
            raise _Mismatch(f"unexpected {ch!r}")
        if kinds is not None and kind not in kinds and not (kind == "number" and "integer" in kinds):
            raise _Mismatch(f"{kind} where the schema wants {sorted(kinds)}")
        if kind == "object":
            return self._object(s)
        if kind == "array":
            return self._array(s)
        if kind == "string":
            return self._string(s)
        if kind == "number":
            return self._number(s)
        return self._literal(s)

    def _string(self, s: dict[str, Any]) -> str | None:
        self.pos += 1
        start = self.pos
        esc = False
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                value = json.loads('"' + self.text[start:self.pos - 1] + '"')
                allowed = [s["const"]] if "const" in s else s.get("enum")
                if isinstance(allowed, list) and value not in allowed:
                    raise _Mismatch(f"{value!r} is not allowed here")
                return None
        raw = self.text[start:]
        fix = ""
        if esc:
            fix = "\\"
        else:
            m = re.search(r"\\u[0-9a-fA-F]{0,3}$", raw)
            if m:
                fix = "0" * (6 - len(m.group()))
        partial = json.loads('"' + raw + fix + '"')
        allowed = [s["const"]] if "const" in s else s.get("enum")
        if isinstance(allowed, list):
            for option in allowed:
                if isinstance(option, str) and option.startswith(partial):
                    return fix + json.dumps(option[len(partial):], ensure_ascii=False)[1:]
            raise _Mismatch(f"no allowed value starts with {partial!r}")
        pad = max(0, int(s.get("minLength", 0)) - len(partial))
        return fix + "x" * pad + '"'

    def _number(self, s: dict[str, Any]) -> str | None:
        m = _NUMBER.match(self.text, self.pos)
        assert m is not None  # the pattern matches the empty string
        self.pos = m.end()
        token = m.group()
        if self.pos < len(self.text):
            return None
        # cut mid-number: complete it so it still meets its bounds, smallest magnitude first
        fix = "0" if token[-1:] in ("-", ".", "e", "E", "+") else ""
        kinds = s.get("type") if isinstance(s.get("type"), list) else [s.get("type")]
        tails = ["", "0", "00", "000", "0000", "00000", "000000"]
        if "integer" not in kinds and "e" not in token.lower():
            tails += ["e-1", "e-2", "e-3", "e-6", "e-9"]
        for tail in tails:
            try:
                value = json.loads(token + fix + tail)
            except ValueError:
                continue
            if _in_bounds(value, s, integer="integer" in kinds and "number" not in kinds):
                return fix + tail
        raise _Mismatch(f"no completion of {token!r} meets the bounds")

    def _literal(self, s: dict[str, Any]) -> str | None:
        for word in ("true", "false", "null"):
            chunk = self.text[self.pos:self.pos + len(word)]
            if word.startswith(chunk):
                self.pos += len(chunk)
                return word[len(chunk):] if len(chunk) < len(word) else None
        raise _Mismatch("not a literal")

    def _rest(self, s: dict[str, Any], seen: list[str], *, first: bool) -> str:
        """Missing required properties with minimal values, then ``}``."""
        props = s.get("properties", {})
        parts = [json.dumps(k) + ":" + self.minimal(props.get(k, {}))
                 for k in s.get("required", []) if k not in seen]
        return ("," if parts and not first else "") + ",".join(parts) + "}"

    def _sub(self, s: dict[str, Any], key: str) -> Any:
        props = s.get("properties", {})
        if key in props:
            return props[key]
        extra = s.get("additionalProperties", True)
        if extra is False:
            raise _Mismatch(f"property {key!r} is not allowed")
        return extra if isinstance(extra, dict) else {}

    def _another(self, s: dict[str, Any], seen: list[str]) -> str:
        """After a trailing comma: one more property must follow."""
        props = s.get("properties", {})
        if any(k not in seen for k in s.get("required", [])):
            return self._rest(s, seen, first=True)
        spare = [k for k in props if k not in seen]
        if spare:
            return json.dumps(spare[0]) + ":" + self.minimal(props[spare[0]]) + "}"
        if s.get("additionalProperties", True) is False:
            raise _Mismatch("a comma with no property left to add")
        return '"_":null}'

    def _object(self, s: dict[str, Any]) -> str | None:
        self.pos += 1
        seen: list[str] = []
        need = False  # after a comma another property must follow
        while True:
            if self._ws():
                return self._another(s, seen) if need else self._rest(s, seen, first=not seen)
            ch = self.text[self.pos]
            if ch == "}" and not need:
                self.pos += 1
                return None
            if ch != '"':
                raise _Mismatch("expected a key")
            start = self.pos
            self.pos += 1
            while self.pos < len(self.text) and self.text[self.pos] != '"':
                self.pos += 2 if self.text[self.pos] == "\\" else 1
            if self.pos >= len(self.text):
                raw = self.text[start + 1:]
                if re.search(r"(?<!\\)(\\\\)*\\(u[0-9a-fA-F]{0,3})?$", raw):
                    raise _Mismatch("a key cut inside an escape")
                partial = json.loads('"' + raw + '"')
                props = s.get("properties", {})
                order = [k for k in s.get("required", []) if k not in seen] + [k for k in props if k not in seen]
                key = next((k for k in order if k.startswith(partial)), None)
                if key is None:
                    if s.get("additionalProperties", True) is False:
                        raise _Mismatch("no property fits the partial key")
                    key = partial
                return (json.dumps(key[len(partial):], ensure_ascii=False)[1:] + ":"
                        + self.minimal(self._sub(s, key)) + self._rest(s, [*seen, key], first=False))
            self.pos += 1
            key = json.loads(self.text[start:self.pos])
            sub = self._sub(s, key)
            if self._ws():
                return ":" + self.minimal(sub) + self._rest(s, [*seen, key], first=False)
            if self.text[self.pos] != ":":
                raise _Mismatch("expected ':'")
            self.pos += 1
            tail = self.value(sub)
            if tail is not None:
                return tail + self._rest(s, [*seen, key], first=False)
            seen.append(key)
            need = False
            if self._ws():
                return self._rest(s, seen, first=False)
            ch = self.text[self.pos]
            self.pos += 1
            if ch == "}":
                return None
            if ch != ",":
                raise _Mismatch("expected ',' or '}'")
            need = True

    def _array(self, s: dict[str, Any]) -> str | None:
        self.pos += 1
        low = int(s.get("minItems", 0))
        n = 0
        need = False

        def fill(count: int) -> str:
            return "".join(("," if i else "") + self.minimal(self._item(s, i)) for i in range(count, low)) + "]"

        while True:
            if self._ws():
                return (self.minimal(self._item(s, n)) + fill(n + 1)) if need else fill(n)
            if self.text[self.pos] == "]" and not need:
                self.pos += 1
                return None
            tail = self.value(self._item(s, n))
            if tail is not None:
                return tail + fill(n + 1)
            n += 1
            need = False
            if self._ws():
                return fill(n)
            ch = self.text[self.pos]
            self.pos += 1
            if ch == "]":
                return None
            if ch != ",":
                raise _Mismatch("expected ',' or ']'")
            need = True


def close_json(prefix: str, schema: dict[str, Any]) -> str | None:
    """The smallest suffix that makes ``prefix`` a document valid under ``schema``.

    Closes open strings, arrays and objects and adds the still-missing
    required properties with minimal values (``""``, ``0`` within bounds,
    ``false``, ``null``, the first enum member, ``minItems`` minimal items); a
    string cut inside an enum or const completes to the matching member.
    Returns ``""`` for a complete document and ``None`` when the prefix cannot
    lead to a valid document (which a grammar-constrained prefix always can).
    """
    closer = _Closer(prefix, schema)
    try:
        tail = closer.value(schema)
    except (_Mismatch, ValueError, RecursionError):
        return None
    if tail is None:
        return "" if closer._ws() else None
    return tail


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
