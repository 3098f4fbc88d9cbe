"""The primitive-runtime interface the generic executor drives.

A primitive runtime (llama.cpp, the mock, later MLX) only knows how to
tokenize, run one batched forward pass over several KV sequences, sample from
the resulting logits, and move KV between sequences. Lanes, chunked prefill,
the prefix cache, finish rules and counter-based seeding live in the executor
(``_executor.py``), written once for every runtime.

All methods are synchronous and are called from one thread at a time (the
worker's engine thread); ``tokenize``/``piece`` may also be called from the
worker's I/O thread and must be safe to run beside ``decode``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs

from ..proto import Sampling
from ..proto._events import MAX_LOGPROBS

__all__ = ["BatchRow", "Engine", "LaneSampler", "ModelInfo", "StepAborted"]


class StepAborted(Exception):  # noqa: N818 - a signal, not an error
    """``decode(rows, abort=...)`` stopped because ``abort()`` returned True: no row
    advanced (whatever the pass had written to KV is removed)."""


@attrs.frozen(kw_only=True)
class ModelInfo:
    name: str
    architecture: str
    n_vocab: int
    n_ctx_train: int
    n_seq: int                 # KV sequences available to the executor
    n_ctx_seq: int             # tokens of KV per sequence (the per-lane window)
    kv_layout: str             # "per_seq" (prefix reuse anywhere) or "shared" (head-only)
    bos: int
    eog: tuple[int, ...]
    chat_template: str
    special_tokens: dict[str, int]
    add_bos: bool
    extra: dict[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["eog"] = list(self.eog)
        return d


@attrs.frozen(kw_only=True)
class BatchRow:
    """``tokens`` go into sequence ``seq`` at positions ``pos0, pos0+1, ...``;
    with ``want_logits`` the row's last token produces logits to sample from,
    and with ``all_logits`` too every token does (a speculative row: its output
    is then a list of handles, one per token; only engines with ``drafts``)."""

    seq: int
    tokens: tuple[int, ...]
    pos0: int
    want_logits: bool
    all_logits: bool = False


class LaneSampler(Protocol):
    def sample(self, out: Any, k: int) -> int:
        """Draw the ``k``-th generated token from decode output handle ``out``."""

    def logprobs(self, out: Any, token: int, n: int) -> list[Any]:
        """``[logprob(token), [[tok, piece, logprob], ...n best]]``."""

    def accept(self, token: int) -> None:
        """Record ``token`` (penalties and grammar state advance)."""

    def embed(self, inputs: list[list[int]], *, normalize: bool) -> tuple[int, list[bytes]]:
        """One pooled vector per input as ``dim`` little-endian float32 (unit length with
        ``normalize``): ``(dim, vectors)``. Called from a worker thread beside ``decode``
        (an embedding context of its own). Raises ValueError for inputs it cannot embed."""

    def close(self) -> None: ...


class Engine(Protocol):
    info: ModelInfo
    aborts: bool   # decode honours ``abort`` (see decode); the executor sizes steps by it
    # decode takes ``all_logits`` rows and ``seq_rm`` drops any suffix: prompt-lookup can run;
    # a string says why not (in the runtime's words)
    drafts: bool | str

    def capabilities(self) -> dict[str, Any]: ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def decode(self, rows: list[BatchRow], abort: Callable[[], bool] | None = None) -> list[Any]:
        """One forward pass for all rows. Returns, per row, an output handle
        (``None`` where ``want_logits`` was false). Raises RuntimeError if the
        runtime could not place the batch (KV full). A runtime that can stop a
        pass midway polls ``abort`` while it computes and raises
        :class:`StepAborted` (KV as before the call) once it returns True; one
        that cannot ignores it."""

    def new_sampler(self, sampling: Sampling, history: list[int]) -> LaneSampler:
        """Raises ValueError if the sampling request (e.g. a grammar) is invalid."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool: ...

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...

    def seq_export(self, seq: int) -> Any:
        """``seq``'s KV state as a bytes-like object (``len`` is its size in
        bytes); empty if the runtime cannot export."""

    def seq_import(self, seq: int, data: Any) -> bool:
        """Load state from :meth:`seq_export` into the empty ``seq``. False
        if the runtime refused it (``seq`` is then unspecified: clear it)."""

    def embed(self, inputs: list[list[int]], *, normalize: bool) -> tuple[int, list[bytes]]:
        """One pooled vector per input as ``dim`` little-endian float32 (unit length with
        ``normalize``): ``(dim, vectors)``. Called from a worker thread beside ``decode``
        (an embedding context of its own). Raises ValueError for inputs it cannot embed."""

    def close(self) -> None: ...



def logprobs_from_logits(logits: Any, token: int, n: int, piece: Any) -> list[Any]:
    """``[logprob of token, [[id, piece, logprob], ...n best]]`` from one row of logits (numpy):
    a log-softmax in float64, the ``n`` best (at most ``MAX_LOGPROBS``) in order, ties stable."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max()
    lp = x - (top + np.log(np.exp(x - top).sum()))
    n = max(0, min(n, MAX_LOGPROBS))
    best: list[Any] = []
    if n:
        idx = np.argpartition(-lp, n - 1)[:n]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        best = [[int(t), piece(int(t)), float(lp[t])] for t in idx]
    return [float(lp[token]), best]


def check_sampling_ranges(s: Sampling) -> None:
    """Refuse sampling values no runtime can apply (the API validates too; this guards the worker).

    Raises:
        ValueError: naming the field.
    """
    if s.repeat_penalty <= 0:
        raise ValueError("repeat_penalty must be > 0")
    if not 0 <= s.top_p <= 1:
        raise ValueError("top_p must be in [0, 1]")
    if not 0 <= s.min_p <= 1:
        raise ValueError("min_p must be in [0, 1]")
    if s.top_k < 0:
        raise ValueError("top_k must be >= 0")
