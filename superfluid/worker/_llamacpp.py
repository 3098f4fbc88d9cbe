"""The llama.cpp primitive runtime, on llama-cpp-python's low-level ctypes API.

Contract (the :class:`~superfluid.worker._engine.Engine` and
:class:`~superfluid.worker._engine.LaneSampler` protocols):

* :meth:`LlamaEngine.decode` runs every row in one ``llama_decode`` and
  returns, per row, the batch index of its logits (``None`` without
  ``want_logits``). When the rows hold more tokens than one batch, the tokens
  that need no logits are decoded first, in earlier calls, and every
  logits-bearing token goes into the final call, so every returned index is
  valid until the next :meth:`decode`. A non-zero return code raises
  RuntimeError (1 = no KV slot); tokens of earlier calls stay decoded.
* ``decode(rows, abort=f)`` polls ``f`` between the graph's nodes (llama.cpp's
  abort callback, installed only for that call) and raises StepAborted once it
  returns True, after removing every row's positions from ``pos0`` on, so the
  KV is as before the call. Only the per-sequence layout honours ``abort``
  (a shared sliding-window or recurrent pool cannot drop a pass's tail); the
  callback costs about 1% of a 512-token pass.
* KV layout: plain-attention models get one KV stream per sequence
  (``kv_unified=False``, ``kv_layout="per_seq"``): any prefix of any sequence
  can be reused. Sliding-window, recurrent and hybrid models cannot drop a
  suffix and keep a usable window, so they get one shared pool of
  ``max_batch * max_context`` cells (``kv_unified=True``,
  ``kv_layout="shared"``): a lane never needs more than ``max_context`` cells
  and at most ``max_batch`` lanes run, so running lanes always fit unless
  cached (finished) sequences hold cells, in which case decode fails with
  code 1. Sliding-window layers keep only their window (``swa_full=False``).
* ``grid`` (True with one KV stream per sequence): a row's logits depend on the
  shape of the pass it is computed in, not on anything else: the same tokens
  at the same positions, in passes whose micro-batches start on multiples of
  the executor's ``GRID`` and hold whole cells, give the same logits, with
  flash attention and repacked weights on; a short last cell computed alone
  differs from the same cell inside a bigger micro-batch (the tiled flash
  attention path starts at 64 query rows; a repacked weight's gemm takes rows
  in fours), and a token decoded alone differs from one prefilled. So the
  executor runs in exact mode over it (``_executor.py``), whose last prompt
  step takes a partial last cell with the full cell before it: under 64 query
  rows, flash attention's non-tiled kernel is slow against a long KV (20 rows
  over 5,200 cells: 2.0 s on 2 cores). The cells a stream
  holds sit in order from cell 0 (a stream is emptied or cut from a position,
  and llama.cpp fills it from the first free cell), so a row also attends
  over the same cells whatever the stream held before. A shared pool places
  a sequence wherever it has room (after the cached sequences it holds),
  which changes the sums' order: ``grid`` is False there.
* ``deterministic=True`` makes a row's logits independent of the other rows
  of its batch (SPEC.md "Determinism" has the measurements): no flash
  attention, no repacked weights (``use_extra_bufts``), and sliding-window
  models in one full-context stream per sequence (``swa_full=True``,
  ``kv_layout="per_seq"``) rather than a shared pool.
* Sampling is a per-lane llama.cpp sampler chain: logit bias, penalties
  (last 64 tokens), grammar, then top-k, top-p, min-p and temperature, then
  greedy (``temperature == 0``) or a distribution draw. The draw for
  generated token ``k`` is seeded with ``counter_seed(seed, k)`` (the dist
  stage is rebuilt before each draw), so a resumed lane draws exactly what
  the uninterrupted lane would have. :meth:`_LaneSampler.sample` uses
  ``llama_sampler_sample``, which also advances the chain (penalties,
  grammar) by the drawn token; the executor's following ``accept`` of that
  same token is therefore a no-op. A draw that is never accepted ends its
  lane (end of generation), so the early advance is never observed.
  Greedy sampling with no penalty and no grammar has no state: it is an
  argmax over the logits (plus any bias) in numpy, which picks the same token
  as the chain (the first of equal maxima) at a fifth of the cost (0.1 vs
  0.5 ms for 8 lanes on SmolLM2's 49,152-token vocabulary).
* Log probabilities come from the raw logits (log-softmax), not from the
  sampler chain's transformed distribution.
* ``tokenize``/``piece`` only read the vocabulary and may run beside
  ``decode`` on another thread.
* Embeddings: :meth:`LlamaEngine.embed` runs in a second llama context of the
  same model (weights shared), created on the first request, with
  ``embeddings=True``, one unified KV pool of one window and up to
  ``EMBED_SEQS`` sequences, pooled as ``--pooling`` says, else as the GGUF's
  ``<arch>.pooling_type`` says, else ``mean`` (decoder models such as SmolLM2
  name none). Several inputs go through one ``llama_decode`` as long as they
  fit in the window's batch; the pool is cleared between batches. It runs on
  the worker's reader side, beside ``decode`` (separate contexts may run on
  separate threads), one batch at a time.

llama.cpp's log output is filtered to errors, written to stderr.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import llama_cpp as L
import numpy as np

from ..proto import Sampling
from ._engine import BatchRow, ModelInfo, StepAborted, check_sampling_ranges, logprobs_from_logits
from ._executor import counter_seed

__all__ = ["LlamaEngine"]

BATCH_TOKENS = 2048
UBATCH_TOKENS = 512
PENALTY_LAST_N = 64
_DEFAULT_SEED = 0xFFFFFFFF       # llama.cpp reads this seed as "pick one at random"
_LOG_ERROR = 4                   # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continue
_LOG_CONT = 5
_MARKER_ATTRS = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
_DECODE_ERRORS = {1: "no KV slot for the batch (KV cache full)", 2: "decode aborted", -1: "invalid batch"}
_NO_MEDIA = "text-only runtime: no multimodal projector is loaded"
EMBED_SEQS = 32                  # inputs in one embedding batch at most
_POOLING = {"none": L.LLAMA_POOLING_TYPE_NONE, "mean": L.LLAMA_POOLING_TYPE_MEAN, "cls": L.LLAMA_POOLING_TYPE_CLS,
            "last": L.LLAMA_POOLING_TYPE_LAST, "rank": L.LLAMA_POOLING_TYPE_RANK}
_POOLING_NAMES = {v: k for k, v in _POOLING.items()}
_NO_ABORT = L.ggml_abort_callback()   # a null function pointer: no abort callback


# -- logging -------------------------------------------------------------------


class _LogFilter:
    """Passes llama.cpp's error lines to stderr and keeps the last few, so a
    failure (an unparsable grammar, a model that will not load) can say why."""

    def __init__(self) -> None:
        self.level = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=8)
        self.echo = True   # off while a model loads: its failure carries the lines (one line on the CLI)

    def __call__(self, level: int, text: bytes | None, _user_data: Any) -> None:
        if level != _LOG_CONT:
            self.level = level
        if self.level != _LOG_ERROR or not text:
            return
        self.recent.append(text.decode("utf-8", "replace").strip())
        if self.echo:
            os.write(2, text)

    def take(self) -> str:
        lines = [ln for ln in self.recent if ln]
        self.recent.clear()
        return "; ".join(lines)


_LOG = _LogFilter()
_LOG_CALLBACK = L.llama_log_callback(_LOG)   # kept alive here: C holds the pointer
_initialized = False


def _init_backend() -> None:
    global _initialized
    L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    if not _initialized:
        L.llama_backend_init()
        _initialized = True


# -- model metadata ------------------------------------------------------------


def _meta(model: Any, key: str) -> str | None:
    """A GGUF metadata value as a string, or None if the key is absent."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1


def _token_piece(vocab: Any, token: int) -> bytes:
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.llama_token_to_piece(vocab, token, buf, size, 0, True)
        if n >= 0:
            return buf.raw[:n]
        size = -n


def _is_marker_text(text: str) -> bool:
    return len(text) > 2 and text[0] in "<[" and text[-1] in ">]" and not any(c.isspace() for c in text)


def _scan_vocab(vocab: Any, n_vocab: int) -> tuple[tuple[int, ...], dict[str, int]]:
    """End-of-generation ids, and the special-marker texts (control tokens and
    marker-looking user-defined tokens; ``<unusedN>`` placeholders skipped)."""
    eog: list[int] = []
    specials: dict[str, int] = {}
    for tok in range(n_vocab):
        if L.llama_vocab_is_eog(vocab, tok):
            eog.append(tok)
        attr = L.llama_vocab_get_attr(vocab, tok)
        if not attr & _MARKER_ATTRS or attr & L.LLAMA_TOKEN_ATTR_UNUSED:
            continue
        text = _token_piece(vocab, tok).decode("utf-8", "replace")
        if attr & L.LLAMA_TOKEN_ATTR_CONTROL or _is_marker_text(text):
            specials.setdefault(text, tok)
    for tok in (L.llama_vocab_bos(vocab), L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)):
        if 0 <= tok < n_vocab:
            specials.setdefault(_token_piece(vocab, tok).decode("utf-8", "replace"), tok)
    return tuple(eog), specials


_NO_FIM = "the model has no fill-in-the-middle tokens (tokenizer.ggml.fim_pre/suf/mid_token_id)"


def _fim_tokens(vocab: Any) -> dict[str, int]:
    """The fill-in-the-middle marker ids llama.cpp found (GGUF ``tokenizer.ggml.fim_*_token_id``,
    else the ``<|fim_prefix|>``/``<fim_prefix>``/``<PRE>`` spellings in the vocabulary): ``pre``,
    ``suf``, ``mid`` and, for the repo-level pattern, ``rep`` and ``sep``; absent ones left out."""
    found = {"pre": L.llama_vocab_fim_pre(vocab), "suf": L.llama_vocab_fim_suf(vocab),
             "mid": L.llama_vocab_fim_mid(vocab), "rep": L.llama_vocab_fim_rep(vocab),
             "sep": L.llama_vocab_fim_sep(vocab)}
    return {k: int(v) for k, v in found.items() if v >= 0}


def _needs_shared_pool(model: Any, *, deterministic: bool = False) -> bool:
    """Sliding-window, recurrent and hybrid memories cannot keep an arbitrary prefix.
    Deterministic mode keeps a sliding-window model's whole context (``swa_full``)
    in one stream per sequence: in a shared pool a row's attention sums run over
    cells whose places depend on the other sequences."""
    swa = L.llama_model_n_swa(model) > 0 and not deterministic
    return swa or bool(L.llama_model_is_recurrent(model)) or bool(L.llama_model_is_hybrid(model))


def _context_params(*, shared: bool, n_seq: int, max_batch: int, n_ctx_seq: int, threads: int,
                    deterministic: bool = False, kv_bits: int = 16) -> Any:
    cp = L.llama_context_default_params()
    if kv_bits == 8:
        if deterministic:
            raise ValueError("--kv-bits 8 needs flash attention, which deterministic mode turns off")
        # q8_0 K and V: llama.cpp quantises V only with flash attention (else the context fails)
        cp.type_k = L.GGML_TYPE_Q8_0
        cp.type_v = L.GGML_TYPE_Q8_0
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    elif kv_bits != 16:
        raise ValueError(f"kv_bits must be 16 or 8, not {kv_bits}")
    if deterministic:
        # flash attention's CPU kernel takes a tiled path for 64+ query rows and splits the KV
        # among threads for a single query over 512+ cells: both change a row's rounding
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.kv_unified = shared
    # a shared pool reuses only whole sequences, so the window is all it needs; one stream per
    # sequence drops suffixes, so it needs every cell
    cp.swa_full = not shared
    cp.n_ctx = max_batch * n_ctx_seq if shared else n_seq * n_ctx_seq
    cp.n_seq_max = n_seq
    cp.n_batch = BATCH_TOKENS
    cp.n_ubatch = UBATCH_TOKENS
    cp.n_threads = threads
    cp.n_threads_batch = threads
    return cp


def _load_model(path: str, *, deterministic: bool = False) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no model file at {path}")
    _LOG.take()
    mp = L.llama_model_default_params()
    # repacked weights (Q4_K, Q8_0 on AVX2) multiply groups of 4 rows with a gemm kernel and
    # the rest with a gemv kernel that rounds differently: a row's result would depend on
    # where it falls in the batch
    mp.use_extra_bufts = not deterministic
    _LOG.echo = False
    try:
        model = L.llama_model_load_from_file(path.encode(), mp)
    finally:
        _LOG.echo = True
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}: {_LOG.take() or 'no reason given'}")
    return model


# -- the engine ----------------------------------------------------------------


class LlamaEngine:
    def __init__(self, model_path: str, *, max_batch: int, max_context: int, threads: int,
                 deterministic: bool = False, pooling: str = "", kv_bits: int = 16) -> None:
        if max_batch < 1 or max_context < 2:
            raise ValueError("max_batch must be >= 1 and max_context >= 2")
        if pooling and pooling not in _POOLING:
            raise ValueError(f"unknown pooling {pooling!r}")
        _init_backend()
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._embed_ctx: Any = None
        self._embed_batch: Any = None
        self._embed_lock = threading.Lock()
        self._abort_check: Callable[[], bool] | None = None
        self._abort_cb = L.ggml_abort_callback(self._poll_abort)   # kept alive here: C holds the pointer
        self._pooling = pooling
        self._deterministic = deterministic
        self._kv_bits = kv_bits
        self._model = _load_model(model_path, deterministic=deterministic)
        try:
            self._setup(model_path, max_batch, max_context, threads or (os.cpu_count() or 2))
        except BaseException:
            self.close()
            raise

    def _setup(self, path: str, max_batch: int, max_context: int, threads: int) -> None:
        model = self._model
        self._vocab = L.llama_model_get_vocab(model)
        self._n_vocab = L.llama_vocab_n_tokens(self._vocab)
        n_ctx_train = L.llama_model_n_ctx_train(model)
        n_ctx_seq = min(max_context, n_ctx_train) if n_ctx_train > 0 else max_context
        n_seq = max(4, max_batch + 2)
        if n_seq > L.llama_max_parallel_sequences():
            raise ValueError(f"max_batch {max_batch} needs {n_seq} KV sequences; llama.cpp allows "
                             f"{L.llama_max_parallel_sequences()}")
        shared = _needs_shared_pool(model, deterministic=self._deterministic)
        cp = _context_params(shared=shared, n_seq=n_seq, max_batch=max_batch, n_ctx_seq=n_ctx_seq, threads=threads,
                             deterministic=self._deterministic, kv_bits=self._kv_bits)
        self._kv_type = f"{int(cp.type_k)}/{int(cp.type_v)}"   # ggml types of K and V (a parked state's shape)
        self._ctx = L.llama_init_from_model(model, cp)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context: {_LOG.take() or 'no reason given'}")
        self._mem = L.llama_get_memory(self._ctx)
        self._cap = min(BATCH_TOKENS, L.llama_n_batch(self._ctx))
        self._batch = L.llama_batch_init(self._cap, 0, 1)
        eog, specials = _scan_vocab(self._vocab, self._n_vocab)
        self._eog = frozenset(eog)
        self._pieces: dict[int, bytes] = {}
        self.aborts = not shared   # only one stream per sequence can drop a pass's tail
        self.parks = True          # seq_export is llama_state_seq_get_data's bytes: --park can write it
        # a row's result depends on the pass's shape (a short last cell computed alone or inside a
        # bigger micro-batch rounds differently): the executor prefills on the fixed grid (exact
        # mode, the last step at least one whole cell plus the partial one) wherever it can reuse
        # whole cells, i.e. with one stream per sequence
        self.grid = not shared
        self.drafts = True if not shared else (
            "llama.cpp keeps this model's sliding-window or recurrent KV in one shared pool, which cannot "
            "drop a rejected draft's tail")
        self.info = ModelInfo(
            name=os.path.basename(path).removesuffix(".gguf"),
            architecture=_meta(model, "general.architecture") or "unknown",
            n_vocab=self._n_vocab, n_ctx_train=n_ctx_train, n_seq=n_seq, n_ctx_seq=n_ctx_seq,
            kv_layout="shared" if shared else "per_seq", bos=L.llama_vocab_bos(self._vocab), eog=eog,
            chat_template=_meta(model, "tokenizer.chat_template") or "", special_tokens=specials,
            add_bos=bool(L.llama_vocab_get_add_bos(self._vocab)), extra=self._extra(threads, shared),
        )

    def _extra(self, threads: int, shared: bool) -> dict[str, Any]:
        return {"general_name": _meta(self._model, "general.name") or "", "n_ctx": L.llama_n_ctx(self._ctx),
                "n_swa": L.llama_model_n_swa(self._model), "n_batch": self._cap, "threads": threads,
                "kv_unified": shared, "deterministic": self._deterministic, "kv_type": self._kv_type,
                "fim": _fim_tokens(self._vocab)}

    def capabilities(self) -> dict[str, Any]:
        per_seq = self.info.kv_layout == "per_seq"
        return {
            "sampling": {"greedy": True, "temperature": True, "seed": True, "top_p": True, "top_k": True,
                         "min_p": True, "logit_bias": True, "repeat_penalty": True, "presence_penalty": True,
                         "frequency_penalty": True},
            "logprobs": True,
            "grammar": True,
            "prefix_cache": True if per_seq else (
                "shared KV pool (sliding-window/recurrent model): only a whole cached sequence is reused"),
            "embeddings": True,
            "input": {"text": True, "image": _NO_MEDIA, "audio": _NO_MEDIA},
            "fim": True if {"pre", "suf", "mid"} <= self.info.extra["fim"].keys() else _NO_FIM,
        }

    # -- vocabulary (safe beside decode) ----------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def piece(self, token: int) -> bytes:
        cached = self._pieces.get(token)
        if cached is None:
            self._check_token(token)
            cached = self._pieces[token] = _token_piece(self._vocab, token)
        return cached

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def _check_token(self, token: int) -> None:
        if not 0 <= token < self._n_vocab:
            raise ValueError(f"token {token} is outside the {self._n_vocab}-token vocabulary")

    # -- forward pass ------------------------------------------------------------

    def decode(self, rows: list[BatchRow], abort: Callable[[], bool] | None = None) -> list[Any]:
        tokens, n_body, outs = _plan(rows)
        if not tokens:
            return outs
        if len(tokens) - n_body > self._cap:
            raise RuntimeError(f"{len(tokens) - n_body} rows want logits; a batch holds {self._cap} tokens")
        bounds = _chunks(len(tokens), self._cap)
        # only one stream per sequence can drop a pass's tail and keep the rest usable
        abortable = abort is not None and self.info.kv_layout == "per_seq"
        if abortable:
            self._abort_check = abort
            L.llama_set_abort_callback(self._ctx, self._abort_cb, None)
            _LOG.echo = False   # an abort logs three error lines; a real failure's lines go into its message
        try:
            for start, end in bounds:
                self._fill(tokens, start, end, n_body)
                rc = L.llama_decode(self._ctx, self._batch)
                if rc == 2 and abortable:
                    # llama.cpp removed the aborted micro-batch; earlier calls' tokens go too
                    for row in rows:
                        L.llama_memory_seq_rm(self._mem, row.seq, row.pos0, -1)
                    _LOG.take()
                    raise StepAborted
                if rc != 0:
                    said = f" ({_LOG.take()})" if abortable else ""
                    raise RuntimeError(f"llama_decode returned {rc}: {_DECODE_ERRORS.get(rc, 'fatal error')}{said}")
        finally:
            if abortable:
                L.llama_set_abort_callback(self._ctx, _NO_ABORT, None)
                self._abort_check = None
                _LOG.echo = True
        last = bounds[-1][0]
        return [None if i is None else [j - last for j in i] if isinstance(i, list) else i - last for i in outs]

    def _poll_abort(self, _data: Any) -> bool:
        """ggml's abort callback: polled by the compute thread between graph nodes
        (about a thousand times a pass on SmolLM2), only while an abortable pass runs."""
        check = self._abort_check
        return bool(check is not None and check())

    def _fill(self, tokens: list[tuple[int, int, int]], start: int, end: int, n_body: int) -> None:
        b = self._batch
        for i in range(end - start):
            tok, pos, seq = tokens[start + i]
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = start + i >= n_body
        b.n_tokens = end - start

    def logits(self, out: Any) -> np.ndarray:
        """The raw logits of batch index ``out`` of the last decode (a view), or ``out`` itself
        when it is logits kept by :meth:`keep_logits`."""
        if isinstance(out, np.ndarray):
            return out
        ptr = L.llama_get_logits_ith(self._ctx, out)
        if not ptr:
            raise RuntimeError(f"no logits at batch index {out}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def keep_logits(self, out: int) -> np.ndarray:
        """A copy of batch index ``out``'s logits that outlives the next decode; a sampler draws
        from it as from ``out`` (the executor's tails: a prompt's last-step logits, kept)."""
        return self.logits(out).copy()

    # -- sampling ----------------------------------------------------------------

    def new_sampler(self, sampling: Sampling, history: list[int]) -> _LaneSampler:
        sampler = _LaneSampler(self, sampling)
        try:
            sampler.replay(history)
        except BaseException:
            sampler.close()
            raise
        return sampler

    # -- KV sequences ------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        return bool(L.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Copy ``src``'s positions ``[p0, p1)`` into ``dst``, which must
        already hold ``src``'s ``[0, p0)`` (the executor passes ``p0 == 0``).
        Separate KV streams can only be copied whole, so a per-sequence copy
        copies the whole stream and then drops the tail from ``p1``."""
        if self.info.kv_layout == "shared":
            L.llama_memory_seq_cp(self._mem, src, dst, p0, p1)
            return
        L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        if p1 >= 0:
            L.llama_memory_seq_rm(self._mem, dst, p1, -1)

    def seq_export(self, seq: int) -> Any:
        size = L.llama_state_seq_get_size(self._ctx, seq)
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(self._ctx, buf, size, seq)
        return buf if written == size else b""

    def seq_import(self, seq: int, data: Any) -> bool:
        if not isinstance(data, ctypes.Array):   # a park read from disk (a bytearray): no copy
            data = (ctypes.c_uint8 * len(data)).from_buffer(data) if isinstance(data, bytearray) else \
                (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return L.llama_state_seq_set_data(self._ctx, data, len(data), seq) > 0

    # -- embeddings ----------------------------------------------------------------

    def pooling(self) -> str:
        """How an input's token vectors are pooled: ``--pooling``, else the GGUF's, else mean."""
        if self._pooling:
            return self._pooling
        arch = _meta(self._model, "general.architecture") or ""
        named = _meta(self._model, f"{arch}.pooling_type")
        if named is not None and named.isdigit() and int(named) in _POOLING_NAMES:
            name = _POOLING_NAMES[int(named)]
            if name not in ("none", "rank"):
                return name
        return "mean"

    def _embed_context(self) -> tuple[Any, Any, int]:
        if self._embed_ctx is None:
            window = self.info.n_ctx_seq
            cp = L.llama_context_default_params()
            cp.embeddings = True
            cp.pooling_type = _POOLING[self.pooling()]
            cp.kv_unified = True
            cp.n_ctx = window
            cp.n_batch = cp.n_ubatch = window  # an input is pooled whole: it goes in one micro-batch
            cp.n_seq_max = min(EMBED_SEQS, L.llama_max_parallel_sequences())
            cp.n_threads = cp.n_threads_batch = self.info.extra["threads"]
            ctx = L.llama_init_from_model(self._model, cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create an embedding context: {_LOG.take() or 'no reason'}")
            self._embed_ctx = ctx
            self._embed_batch = L.llama_batch_init(window, 0, 1)
        n_embd = getattr(L, "llama_model_n_embd_out", L.llama_model_n_embd)(self._model)
        return self._embed_ctx, self._embed_batch, int(n_embd)

    def embed(self, inputs: list[list[int]], *, normalize: bool) -> tuple[int, list[bytes]]:
        window = self.info.n_ctx_seq
        for i, tokens in enumerate(inputs):
            if len(tokens) > window:
                raise ValueError(f"input {i} has {len(tokens)} tokens; the model's window is {window}")
            for tok in tokens:
                self._check_token(tok)
        with self._embed_lock:
            ctx, batch, dim = self._embed_context()
            n_seq = min(EMBED_SEQS, L.llama_max_parallel_sequences())
            mem = L.llama_get_memory(ctx)
            out: list[bytes] = []
            start = 0
            while start < len(inputs):
                end, used = start, 0
                while end < len(inputs) and end - start < n_seq and used + len(inputs[end]) <= window:
                    used += len(inputs[end])
                    end += 1
                n = 0
                for seq, tokens in enumerate(inputs[start:end]):
                    for pos, tok in enumerate(tokens):
                        batch.token[n], batch.pos[n], batch.n_seq_id[n] = tok, pos, 1
                        batch.seq_id[n][0] = seq
                        batch.logits[n] = True
                        n += 1
                batch.n_tokens = n
                L.llama_memory_clear(mem, True)
                rc = L.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc} for embeddings: {_DECODE_ERRORS.get(rc, 'fatal')}")
                for seq in range(end - start):
                    ptr = L.llama_get_embeddings_seq(ctx, seq)
                    if not ptr:
                        raise RuntimeError("llama.cpp returned no pooled embedding")
                    vec = np.ctypeslib.as_array(ptr, shape=(dim,)).astype(np.float64)
                    if normalize:
                        norm = float(np.linalg.norm(vec))
                        vec = vec / norm if norm > 0 else vec
                    out.append(vec.astype("<f4").tobytes())
                start = end
            return dim, out

    def close(self) -> None:
        if self._embed_batch is not None:
            L.llama_batch_free(self._embed_batch)
            self._embed_batch = None
        if self._embed_ctx is not None:
            L.llama_free(self._embed_ctx)
            self._embed_ctx = None
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            L.llama_model_free(self._model)
            self._model = None


def _plan(rows: list[BatchRow]) -> tuple[list[tuple[int, int, int]], int, list[Any]]:
    """Lay the rows out as (token, pos, seq) entries: every token that needs no
    logits first (in row order), then each logits row's last token (every token
    of an ``all_logits`` row). Returns the entries, how many need no logits, and
    per row the entry index of its logits (a list for an ``all_logits`` row)."""
    body: list[tuple[int, int, int]] = []
    tails: list[tuple[int, int, int]] = []
    tail_of: list[Any] = []
    for row in rows:
        n = len(row.tokens)
        if n == 0:
            raise ValueError(f"an empty batch row for sequence {row.seq}")
        if row.all_logits and row.want_logits:
            tail_of.append(list(range(len(tails), len(tails) + n)))
            tails.extend((row.tokens[j], row.pos0 + j, row.seq) for j in range(n))
            continue
        head = n - 1 if row.want_logits else n
        body.extend((row.tokens[j], row.pos0 + j, row.seq) for j in range(head))
        if row.want_logits:
            tail_of.append(len(tails))
            tails.append((row.tokens[-1], row.pos0 + n - 1, row.seq))
        else:
            tail_of.append(None)
    n_body = len(body)
    return body + tails, n_body, [None if t is None else [n_body + i for i in t] if isinstance(t, list)
                                  else n_body + t for t in tail_of]


def _chunks(total: int, cap: int) -> list[tuple[int, int]]:
    """Split ``total`` entries into batches of at most ``cap``, the *first* one
    short, so the final batch holds the last ``cap`` entries (the logits ones)."""
    first = total % cap or cap
    bounds = [(0, first)]
    while bounds[-1][1] < total:
        start = bounds[-1][1]
        bounds.append((start, start + cap))
    return bounds


# -- per-lane sampler ------------------------------------------------------------


def _logit_bias_stage(n_vocab: int, bias: tuple[tuple[int, float], ...]) -> Any:
    arr = (L.llama_logit_bias * len(bias))()
    for i, (tok, value) in enumerate(bias):
        if not 0 <= tok < n_vocab:
            raise ValueError(f"logit_bias token {tok} is outside the {n_vocab}-token vocabulary")
        arr[i].token = tok
        arr[i].bias = value
    return L.llama_sampler_init_logit_bias(n_vocab, len(bias), arr)


def to_gbnf(grammar: str) -> str:
    """The daemon sends ``json``, ``json_schema:<schema JSON>`` or raw GBNF.

    Raises:
        ValueError: the schema cannot be turned into a grammar.
    """
    from llama_cpp import llama_grammar

    if grammar == "json":
        return llama_grammar.JSON_GBNF
    if grammar.startswith("json_schema:"):
        try:
            return llama_grammar.json_schema_to_gbnf(grammar[len("json_schema:"):])
        except Exception as exc:  # noqa: BLE001 - the converter raises many types for unsupported schemas
            raise ValueError(f"JSON schema cannot be compiled to a grammar: {exc}") from None
    return grammar


def _grammar_stage(vocab: Any, grammar: str) -> Any:
    grammar = to_gbnf(grammar)
    _LOG.take()  # drop stale lines: what follows a NULL is this grammar's reason
    stage = L.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not stage:
        raise ValueError(f"invalid grammar: {_LOG.take() or 'llama.cpp could not parse it'}")
    return stage


def _check_sampling(s: Sampling) -> None:
    check_sampling_ranges(s)


def _dist_seed(seed: int, k: int) -> int:
    value = counter_seed(seed, k)
    return value - 1 if value == _DEFAULT_SEED else value


class _LaneSampler:
    """One lane's sampler chain (see the module docstring for the contract)."""

    def __init__(self, engine: LlamaEngine, sampling: Sampling) -> None:
        _check_sampling(sampling)
        self._engine = engine
        self._seed = sampling.seed
        self._greedy = sampling.greedy
        self._grammar_at: int | None = None
        self._drawn: int | None = None
        # stateless greedy: argmax over the logits, the bias added to a copy
        self._argmax = sampling.greedy and not sampling.grammar and sampling.repeat_penalty == 1.0 and not (
            sampling.presence_penalty or sampling.frequency_penalty)
        self._bias_tokens = np.array([t for t, _b in sampling.logit_bias], dtype=np.int64)
        self._bias_values = np.array([b for _t, b in sampling.logit_bias], dtype=np.float32)
        self._chain: Any = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        try:
            self._build(sampling)
        except BaseException:
            self.close()
            raise

    def _add(self, stage: Any) -> None:
        L.llama_sampler_chain_add(self._chain, stage)

    def _build(self, s: Sampling) -> None:
        eng = self._engine
        if s.logit_bias:
            self._add(_logit_bias_stage(eng._n_vocab, s.logit_bias))
        if s.repeat_penalty != 1.0 or s.presence_penalty or s.frequency_penalty:
            self._add(L.llama_sampler_init_penalties(eng._n_vocab, PENALTY_LAST_N, s.repeat_penalty,
                                                     s.frequency_penalty, s.presence_penalty))
        if s.grammar:
            self._grammar_at = L.llama_sampler_chain_n(self._chain)
            self._add(_grammar_stage(eng._vocab, s.grammar))
        if self._greedy:
            self._add(L.llama_sampler_init_greedy())
            return
        if s.top_k > 0:
            self._add(L.llama_sampler_init_top_k(s.top_k))
        if s.top_p < 1.0:
            self._add(L.llama_sampler_init_top_p(s.top_p, 1))
        if s.min_p > 0.0:
            self._add(L.llama_sampler_init_min_p(s.min_p, 1))
        self._add(L.llama_sampler_init_temp(s.temperature))
        self._add(L.llama_sampler_init_dist(_dist_seed(self._seed, 0)))

    def replay(self, history: list[int]) -> None:
        """Advance penalties and grammar over a resumed lane's generated tokens."""
        for tok in history:
            self._accept_external(tok)

    def _accept_external(self, token: int) -> None:
        """Accept a token this chain did not draw, refusing one the grammar rejects."""
        self._engine._check_token(token)
        if self._grammar_at is not None and not self._grammar_allows(token):
            raise ValueError(f"token {token} does not match the grammar")
        L.llama_sampler_accept(self._chain, token)

    def _grammar_allows(self, token: int) -> bool:
        # llama.cpp aborts the process on accepting a token the grammar rejects;
        # ask the grammar stage first, on a one-candidate array
        cand = L.llama_token_data(id=token, logit=0.0, p=0.0)
        arr = L.llama_token_data_array(data=ctypes.pointer(cand), size=1, selected=-1, sorted=False)
        L.llama_sampler_apply(L.llama_sampler_chain_get(self._chain, self._grammar_at), ctypes.byref(arr))
        return bool(np.isfinite(arr.data[0].logit))

    def _reseed(self, k: int) -> None:
        last = L.llama_sampler_chain_n(self._chain) - 1
        L.llama_sampler_free(L.llama_sampler_chain_remove(self._chain, last))
        self._add(L.llama_sampler_init_dist(_dist_seed(self._seed, k)))

    def sample(self, out: Any, k: int) -> int:
        if self._argmax:
            x = self._engine.logits(out)
            if len(self._bias_tokens):
                x = x.copy()
                np.add.at(x, self._bias_tokens, self._bias_values)
            self._drawn = token = int(np.argmax(x))
            return token
        if not self._greedy:
            self._reseed(k)
        if isinstance(out, np.ndarray):
            token = self._sample_kept(out)
        else:
            token = int(L.llama_sampler_sample(self._chain, self._engine._ctx, out))
        self._drawn = token
        return token

    def _sample_kept(self, logits: np.ndarray) -> int:
        """``llama_sampler_sample`` over kept logits: every token a candidate with its logit, the
        chain applied, its pick accepted (what llama.cpp does over a context's logits)."""
        n = len(logits)
        cand = (L.llama_token_data * n)()
        view = np.ctypeslib.as_array(cand)   # fields id, logit, p
        view["id"] = np.arange(n, dtype=np.int32)
        view["logit"] = logits
        view["p"] = 0.0
        arr = L.llama_token_data_array(data=cand, size=n, selected=-1, sorted=False)
        L.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise RuntimeError(f"the sampler chain selected {arr.selected} of {arr.size} candidates")
        token = int(arr.data[arr.selected].id)
        L.llama_sampler_accept(self._chain, token)
        return token

    def logprobs(self, out: Any, token: int, n: int) -> list[Any]:
        return logprobs_from_logits(self._engine.logits(out), token, n, self._engine.piece)

    def accept(self, token: int) -> None:
        drawn, self._drawn = self._drawn, None
        if drawn is None:
            self._accept_external(token)
        elif drawn != token:
            raise RuntimeError(f"accept({token}) after drawing {drawn}: the chain already advanced by the draw")

    def close(self) -> None:
        if self._chain is not None:
            L.llama_sampler_free(self._chain)
            self._chain = None


def open_engine(model: str, *, max_batch: int, max_context: int, threads: int,
                deterministic: bool = False, pooling: str = "", kv_bits: int = 16) -> LlamaEngine:
    """The registry's entry point (``superfluid.runtime._registry``): every engine module has one."""
    return LlamaEngine(model, max_batch=max_batch, max_context=max_context, threads=threads,
                       deterministic=deterministic, pooling=pooling, kv_bits=kv_bits)
