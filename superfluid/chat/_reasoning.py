"""Reasoning channels: split a ``<think>…</think>`` prelude out of a reply.

Reasoning models open their reply with a thought channel (``<think>`` for
Qwen3, DeepSeek-R1, GLM, Nemotron; ``<|channel>thought … <channel|>`` for
Gemma 4) and then answer. :class:`ReasoningSplitter` is a small streaming
state machine over released reply text: it yields ``("reasoning", text)`` and
``("content", text)`` pieces, holding back only the few characters that could
still become a channel marker, so that no marker ever reaches a client.

The channel is recognised only as the reply's *prelude* (an open marker
before any content): a model that later writes ``<think>`` in prose is
quoting, not reasoning. When the template's generation prompt already opened
the channel (``…assistant\\n<think>\\n``), the splitter starts inside it.
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["THINK_TAGS", "ReasoningSplitter", "partial_marker", "reasoning_tags"]

Channel = Literal["reasoning", "content"]

THINK_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<|channel>thought", "<channel|>"),
)


def reasoning_tags(template_source: str) -> tuple[str, str] | None:
    """The reasoning channel markers a chat template uses, or ``None``."""
    for open_tag, close_tag in THINK_TAGS:
        if open_tag in template_source and close_tag in template_source:
            return open_tag, close_tag
    return None


def partial_marker(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


@attrs.define
class ReasoningSplitter:
    """Streaming split of a reply into reasoning and content.

    Feed released text with :meth:`feed`, then call :meth:`finish` once. The
    concatenation of every ``content`` piece is the reply without its
    reasoning prelude (leading blank lines after the channel are dropped); the
    concatenation of ``reasoning`` pieces is the thought text, stripped of the
    markers.
    """

    open_tag: str = "<think>"
    close_tag: str = "</think>"
    inside: bool = False
    _state: Literal["start", "reasoning", "after", "content"] = attrs.field(default="start", init=False)
    _buf: str = attrs.field(default="", init=False)

    def __attrs_post_init__(self) -> None:
        if self.inside:
            self._state = "reasoning"

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        """Add released text; return the pieces now safe to emit."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[Channel, str]]:
        """Flush at the end of the reply (an unclosed channel stays reasoning)."""
        return self._drain(final=True)

    @property
    def reasoning_open(self) -> bool:
        """Whether the reply is (still) inside the reasoning channel."""
        return self._state == "reasoning"

    def _drain(self, *, final: bool) -> list[tuple[Channel, str]]:
        out: list[tuple[Channel, str]] = []
        while True:
            buf = self._buf
            if self._state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(self.open_tag):
                    self._buf = stripped[len(self.open_tag):]
                    self._state = "reasoning"
                    continue
                if not final and (not stripped or self.open_tag.startswith(stripped)):
                    return out  # could still become the open marker
                self._state = "content"
                continue
            if self._state == "reasoning":
                cut = buf.find(self.close_tag)
                if cut >= 0:
                    if cut:
                        out.append(("reasoning", buf[:cut]))
                    self._buf = buf[cut + len(self.close_tag):]
                    self._state = "after"
                    continue
                hold = 0 if final else partial_marker(buf, self.close_tag)
                if len(buf) > hold:
                    out.append(("reasoning", buf[: len(buf) - hold]))
                self._buf = buf[len(buf) - hold:]
                return out
            if self._state == "after":
                stripped = buf.lstrip()
                if not stripped and not final:
                    return out
                self._buf = stripped
                self._state = "content"
                continue
            if buf:
                out.append(("content", buf))
            self._buf = ""
            return out
