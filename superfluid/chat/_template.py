"""Chat templates: the model's own Jinja template, sandboxed, with curated
fallbacks, rendered into *segments* for tokenization.

Client text never passes through special-token parsing: every client string
the template sees (message content, ``name``, ``reasoning_content``, call
arguments, tool names, descriptions and schemas, ``chat_template_kwargs``
values) is replaced by a sentinel before rendering, and the rendered text is
split back into ``(scaffold, True)`` and ``(data, False)`` segments. The
worker parses markers only in scaffold, so ``<|im_start|>`` typed by a user is
tokenized as plain text and cannot open a turn. Sentinels carry a random
per-render nonce, so client text that looks like one is only text.

Short plain strings (ids, tool names, enum values such as ``"high"``) stay
themselves, so templates can still compare and measure them: a string of
``[A-Za-z0-9_.:/-]`` holding none of the model's special tokens cannot open a
turn. Message content is always data.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML", "GEMMA", "MAX_TEMPLATE_FILE_BYTES", "TEMPLATE_NAMES", "ChatTemplate", "TemplateRenderError",
           "pick_template", "read_template_file"]

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
_PLAIN = re.compile(r"[A-Za-z0-9_.:/-]{0,128}")
MAX_TEMPLATE_FILE_BYTES = 1 << 20   # a chat template file (the largest models' own are under 64 KiB)
# variables and globals a template sees besides client kwargs; a kwarg may not shadow one
TEMPLATE_NAMES = frozenset({
    "messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now",
    "range", "dict", "lipsum", "cycler", "joiner", "namespace", "loop", "self", "true", "false", "none",
})


class TemplateRenderError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed."""


def _raise_exception(message: str) -> None:
    raise TemplateRenderError(message)


class _Data:
    """One render's client strings: each is swapped for a sentinel the template
    sees, and swapped back as a ``(text, False)`` segment after rendering."""

    def __init__(self, specials: Collection[str]) -> None:
        self.specials = specials
        self.texts: list[str] = []
        nonce = secrets.token_hex(8)
        self.prefix = f"\ue000{nonce}."
        self.pattern = re.compile(f"\ue000{nonce}\\.(\\d+)\ue001")

    def mark(self, text: str) -> str:
        self.texts.append(text)
        return f"{self.prefix}{len(self.texts) - 1}\ue001"

    def plain(self, text: str) -> bool:
        return _PLAIN.fullmatch(text) is not None and not any(tok in text for tok in self.specials)

    def value(self, v: Any) -> Any:
        """A JSON value with every string that is not plain (keys too) marked as data."""
        if isinstance(v, str):
            return v if self.plain(v) else self.mark(v)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {(k if not isinstance(k, str) or self.plain(k) else self.mark(k)): self.value(x)
                    for k, x in v.items()}
        return v

    def restore(self, v: Any) -> Any:
        """The inverse of :meth:`value`, for ``tojson``."""
        if isinstance(v, str):
            return self.pattern.sub(lambda m: self.texts[int(m.group(1))], v)
        if isinstance(v, (list, tuple)):
            return [self.restore(x) for x in v]
        if isinstance(v, dict):
            return {self.restore(k): self.restore(x) for k, x in v.items()}
        return v

    def split(self, text: str) -> list[tuple[str, bool]]:
        segments: list[tuple[str, bool]] = []
        pos = 0
        for m in self.pattern.finditer(text):
            if m.start() > pos:
                segments.append((text[pos : m.start()], True))
            segments.append((self.texts[int(m.group(1))], False))
            pos = m.end()
        if pos < len(text):
            segments.append((text[pos:], True))
        return [s for s in segments if s[0]]


_rendering: ContextVar[_Data] = ContextVar("_rendering")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_kw: Any) -> str:
    """JSON of client values is data: the document, client strings restored, as one sentinel."""
    data = _rendering.get()
    return data.mark(json.dumps(data.restore(value), indent=indent, ensure_ascii=ensure_ascii))


def pick_template(model_template: str, special_tokens: dict[str, int]) -> tuple[str, str]:
    """Return ``(template source, kind)``: the model's own, else a curated one."""
    if model_template.strip():
        return model_template, "model"
    if "<|im_start|>" in special_tokens:
        return CHATML, "chatml"
    if "<start_of_turn>" in special_tokens:
        return GEMMA, "gemma"
    return PLAIN, "plain"


def read_template_file(path: Path) -> str:
    """The source of the chat template in ``path`` (``serve --chat-template-file``), checked to
    compile in the sandbox every render uses.

    Raises:
        ValueError: one line saying why not (missing, unreadable, too large, not UTF-8, does not compile).
    """
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_TEMPLATE_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TEMPLATE_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_TEMPLATE_FILE_BYTES} bytes; is it a chat template?")
    try:
        source = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if not source.strip():
        raise ValueError(f"{path}: the file is empty")
    try:
        ChatTemplate(source)
    except TemplateRenderError as exc:
        raise ValueError(f"{path}: {' '.join(str(exc).split())}") from None
    return source


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", kind: str = "model",
                 specials: Collection[str] = ()) -> None:
        self.source = source
        self.specials = tuple(specials)
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
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[tuple[str, bool]]:
        """Render into ``[(text, parse_special), ...]`` segments; every client
        string (``messages`` but their roles, ``tools``, ``kwargs`` values) is data.
        ``kwargs`` are further template variables (``chat_template_kwargs``).

        Raises:
            TemplateRenderError: the template refused the input or failed on it,
                or a kwarg shadows one of :data:`TEMPLATE_NAMES`.
        """
        kwargs = kwargs or {}
        shadowed = sorted(TEMPLATE_NAMES & set(kwargs))
        if shadowed:
            raise TemplateRenderError(f"template argument {shadowed[0]!r} shadows a template variable")
        data = _Data(self.specials)
        shadow = []
        for message in messages:
            m = {k: (v if k == "role" else data.value(v)) for k, v in message.items() if k != "content"}
            content = message.get("content")
            m["content"] = data.mark(content) if isinstance(content, str) else data.value(content)
            shadow.append(m)
        token = _rendering.set(data)
        try:
            text = self._template.render(
                messages=shadow, add_generation_prompt=add_generation_prompt,
                tools=data.value(tools) if tools else None, bos_token=self.bos_token, eos_token=self.eos_token,
                **{k: data.value(v) for k, v in kwargs.items()},
            )
        except TemplateRenderError:
            raise
        except Exception as exc:  # noqa: BLE001 -- boundary: a model's template on client data; any failure is the input's
            raise TemplateRenderError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _rendering.reset(token)
        return data.split(text)
