"""JSON repair and forced-truncation recovery for tool-call and reply documents.

:func:`repair_json` salvages what a model wrote when that is safe (code
fences, prose around the document, trailing commas, an unterminated tail).
:func:`close_json` closes a document cut short by ``max_tokens`` to the
smallest completion that validates against the call schema, so a forced
call's arguments always parse; :func:`document_schema` is the schema of a
``response_format`` reply, whose cut document is closed the same way.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

__all__ = ["close_json", "document_schema", "repair_json"]


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


def document_schema(grammar: str) -> dict[str, Any] | None:
    """The schema of a reply constrained by the worker grammar ``grammar``: any
    object for ``json`` (``json_object``), the schema of ``json_schema:…``; None
    for free text or raw GBNF, whose ending nothing here knows."""
    if grammar == "json":
        return {"type": "object"}
    if grammar.startswith("json_schema:"):
        try:
            schema = json.loads(grammar[len("json_schema:"):])
        except ValueError:
            return None
        return schema if isinstance(schema, dict) else None
    return None


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
