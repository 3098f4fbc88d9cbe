"""Text from outside, shown to a person: a log line or a terminal never runs what a client wrote.

A request's path, a header, a model name, a session id or an error message quoting any of
them can hold characters that are not text but commands to whatever shows them: ESC starts a
terminal escape sequence (clear the screen, set the window title, move the cursor), CR and LF
start a forged log line, NEL, U+2028 and U+2029 end a line for many readers (Python's
``str.splitlines`` among them), and the bidi overrides reorder what the eye reads. Escaping at
the sink (the log formatters, the monitor, the CLI's printing), not at each call, is what
keeps a future log call from forgetting it.

:func:`printable` writes each such character as a visible escape (``\\x1b``, ``\\u2028``);
:func:`json_printable` does the same inside JSON text, where the escape is JSON's own
(``\\u001b``), so a decoder still gets back the exact string.
"""

from __future__ import annotations

import re

__all__ = ["json_printable", "printable"]

# C0 controls, DEL, C1 controls (NEL, CSI …), lone surrogates (no encoder can write them),
# the Arabic letter mark, LRM/RLM, the line and paragraph separators, the bidi embeddings and
# overrides (U+202A-202E) and isolates (U+2066-2069).
_WIDE = "\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE_RE = re.compile(f"[\x00-\x1f{_WIDE}]")
_UNSAFE_BUT_NEWLINE_RE = re.compile(f"[\x00-\x09\x0b-\x1f{_WIDE}]")
_JSON_UNSAFE_RE = re.compile(f"[{_WIDE}]")  # JSON already escapes C0 (and ``"``, ``\\``): DEL and up


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def _json_escape(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control, separator and bidi-control character written as a
    visible escape (``\\x1b``, ``\\x0a``, ``\\u202e``); other text, non-ASCII letters
    included, as it was. ``keep_newlines`` leaves ``\\n`` alone (a traceback's lines).
    Backslashes stay as they are: the aim is a line nobody can forge or use to drive a
    terminal, not a reversible encoding."""
    if text.isprintable():  # false for every character escaped here (Cc, Cf, Cs, Zl, Zp): the usual line, fast
        return text
    return (_UNSAFE_BUT_NEWLINE_RE if keep_newlines else _UNSAFE_RE).sub(_escape, text)


def json_printable(encoded: str) -> str:
    """JSON text (from ``json.dumps(..., ensure_ascii=False)``) with the characters
    ``json.dumps`` leaves raw (DEL, C1, separators, bidi controls, lone surrogates) as
    ``\\uXXXX`` escapes: the same JSON value, one line under any line splitter, safe to
    ``cat``. Outside strings JSON text is ASCII, so every match is inside a string."""
    if encoded.isprintable():
        return encoded
    return _JSON_UNSAFE_RE.sub(_json_escape, encoded)
