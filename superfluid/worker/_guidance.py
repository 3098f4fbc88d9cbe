"""Grammars for host-side samplers (MLX), on llguidance: the engine llama.cpp itself can use.

The worker's grammar strings are the API layer's (``api/_chat.py``): ``"json"`` (any JSON
object, as llama.cpp's ``JSON_GBNF``), ``"json_schema:<schema>"``, or GBNF text (converted to
Lark). :class:`Grammars` builds the runtime's llguidance tokenizer once, from the model's
``tokenizer.json``, with the model's end-of-generation tokens as its EOS set, so a finished
grammar allows exactly those. :class:`HostGrammar` is one lane's matcher: ``mask`` sets every
token the grammar forbids to ``-inf`` in a logits row (numpy), ``consume`` advances it by a
token, refusing one it does not allow. Importing this module does not import llguidance.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

__all__ = ["Grammars", "HostGrammar"]

# JSON as ``json.dumps`` writes it (", " and ": ", no other whitespace): llguidance's default lets
# whitespace repeat between every lexeme, and a small model fills its budget with it. Keywords
# llguidance does not implement are ignored, as llama.cpp's schema converter ignores them.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


class Grammars:
    """Compiles grammar strings for one vocabulary (``n_vocab`` logits per row)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eog: tuple[int, ...]) -> None:
        self._source = tokenizer_json
        self.n_vocab = n_vocab
        self._eog = list(eog)
        self._tok: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._tok is None:
                from llguidance import LLTokenizer

                # ~0.4 s for a 49k vocabulary: built on the first constrained request only
                self._tok = LLTokenizer(self._source, n_vocab=self.n_vocab, eos_token=self._eog or None)
            return self._tok

    def compile(self, grammar: str) -> HostGrammar:
        """A fresh matcher for ``grammar``.

        Raises:
            ValueError: the grammar (or JSON schema) cannot be compiled, in llguidance's words.
        """
        from llguidance import LLMatcher

        if grammar == "json":
            spec = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        elif grammar.startswith("json_schema:"):
            try:
                schema = json.loads(grammar[len("json_schema:"):])
            except ValueError as exc:
                raise ValueError(f"JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("JSON schema cannot be compiled to a grammar: a schema is an object")
            spec = LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        else:
            from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

            try:
                spec = LLMatcher.grammar_from_lark(gbnf_to_lark(grammar))
            except GbnfToLarkError as exc:
                raise ValueError(f"invalid grammar: {exc}") from None
        matcher = LLMatcher(self._tokenizer(), spec, log_level=0)
        if matcher.is_error():
            reason = matcher.get_error().strip().splitlines()[0] if matcher.get_error().strip() else "rejected"
            raise ValueError(f"invalid grammar: {reason}")
        return HostGrammar(matcher, self.n_vocab)


class HostGrammar:
    """One lane's grammar state (see the module docstring)."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._m = matcher
        self._n = n_vocab

    def allowed(self) -> np.ndarray:
        """A boolean row: which tokens the grammar allows next."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        row = np.unpackbits(bits, bitorder="little")[: self._n].astype(bool)
        if len(row) < self._n:   # the model has more logits than the tokenizer has tokens
            row = np.concatenate([row, np.zeros(self._n - len(row), dtype=bool)])
        return row

    def mask(self, x: np.ndarray) -> None:
        """Forbidden tokens to ``-inf`` in ``x``, in place.

        Raises:
            ValueError: the grammar allows no token at all (an error state).
        """
        ok = self.allowed()
        if self._m.is_error() or not ok.any():
            raise ValueError(f"the grammar allows no next token: {self._m.get_error() or 'dead end'}")
        x[~ok] = -np.inf

    def consume(self, token: int) -> None:
        """Advance by ``token``.

        Raises:
            ValueError: the grammar does not allow ``token`` here (the state is unchanged).
        """
        if self._m.validate_tokens([token]) != 1:
            raise ValueError(f"token {token} does not match the grammar")
        if not self._m.consume_token(token):
            raise ValueError(f"token {token} does not match the grammar: {self._m.get_error()}")
