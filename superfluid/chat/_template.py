"""Chat templates: the model's own Jinja template, sandboxed, with curated
fallbacks, rendered into *segments* for tokenization.

Client text never passes through special-token parsing: each message's
content is replaced by a sentinel before rendering, and the rendered text is
split back into ``(scaffold, True)`` and ``(content, False)`` segments. The
worker parses markers only in scaffold, so ``<|im_start|>`` typed by a user is
tokenized as plain text and cannot open a turn.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML", "GEMMA", "ChatTemplate", "TemplateRenderError", "pick_template"]

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PLAIN = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


class TemplateRenderError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed."""


def _raise_exception(message: str) -> None:
    raise TemplateRenderError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_kw: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def pick_template(model_template: str, special_tokens: dict[str, int]) -> tuple[str, str]:
    """Return ``(template source, kind)``: the model's own, else a curated one."""
    if model_template.strip():
        return model_template, "model"
    if "<|im_start|>" in special_tokens:
        return CHATML, "chatml"
    if "<start_of_turn>" in special_tokens:
        return GEMMA, "gemma"
    return PLAIN, "plain"


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", kind: str = "model") -> None:
        self.source = source
        self.kind = kind
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise TemplateRenderError(f"chat template does not compile: {exc}") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[tuple[str, bool]]:
        """Render into ``[(text, parse_special), ...]`` segments.

        Raises:
            TemplateRenderError: the template refused the input.
        """
        contents: list[str] = []
        shadow = []
        for message in messages:
            m = dict(message)
            content = m.get("content")
            if isinstance(content, str):
                contents.append(content)
                m["content"] = f"\ue000{len(contents) - 1}\ue001"
            shadow.append(m)
        try:
            text = self._template.render(
                messages=shadow, add_generation_prompt=add_generation_prompt, tools=tools or None,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
            )
        except TemplateRenderError:
            raise
        except TemplateError as exc:
            raise TemplateRenderError(f"chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateRenderError(f"chat template failed: {exc}") from None
        segments: list[tuple[str, bool]] = []
        pos = 0
        for m in _SENTINEL.finditer(text):
            if m.start() > pos:
                segments.append((text[pos : m.start()], True))
            segments.append((contents[int(m.group(1))], False))
            pos = m.end()
        if pos < len(text):
            segments.append((text[pos:], True))
        return [s for s in segments if s[0]]
