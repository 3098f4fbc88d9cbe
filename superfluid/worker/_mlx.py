"""The MLX primitive runtime, on mlx-lm (Apple silicon, or the CPU device on Linux).

Contract (the :class:`~superfluid.worker._engine.Engine` and
:class:`~superfluid.worker._engine.LaneSampler` protocols):

* Loads an MLX model directory (``config.json``, ``*.safetensors``,
  ``tokenizer.json``) with ``mlx_lm.utils.load_model``. A directory that
  ships Python code (``*.py`` files, or a config naming a ``model_file`` or an
  ``auto_map``) is refused unless ``SUPERFLUID_MLX_TRUST_MODEL_CODE=1``.
  Before loading, the weights must fit: weights + 10% + 1 GiB, leaving
  max(4 GiB, 10% of RAM) free (``SUPERFLUID_MLX_SKIP_FIT_CHECK=1`` skips it);
  otherwise :class:`MemoryFitError`.
* KV: one mlx-lm ``KVCache`` list (one per layer) per sequence
  (``kv_layout="per_seq"``), so any prefix of any sequence can be reused:
  ``seq_rm`` trims, ``seq_cp`` copies the first ``p1`` positions (MLX arrays
  are immutable values, so a copy shares storage until either side writes).
* :meth:`MlxEngine.decode` runs each row as its own forward pass over its
  sequence's cache, all rows' graphs evaluated together in one ``mx.eval``;
  the handle per row is that row's last-position logits as a float32 numpy
  array. Given ``abort``, a prompt pass runs in pieces of ``ABORT_PIECE``
  (64) tokens, asking ``abort`` before each; once it says so, every row's
  cache is trimmed back to its ``pos0`` and :class:`StepAborted` is raised.
  A decode round (one token for each of several sequences) can instead run
  as one batched pass (``_DecodeView``: per-layer caches left-padded into
  a batch, a per-row mask and RoPE offsets); that is the default, except in a
  deterministic worker (8 lanes on the CPU: 206 ms a round batched vs 732 ms
  per lane with f32 weights, 1.33 s vs 1.78 s with 4-bit ones;
  ``SUPERFLUID_MLX_BATCH_DECODE=0|1`` overrides).
* Prompt-lookup speculation (``drafts``): a drafting round's rows all carry the
  same number of tokens (the pending one and the drafts); they run as one batched
  pass too, each row's queries masked causally over its own left-padded keys, and
  an ``all_logits`` row's handle is a list of per-position logits. A rejected
  tail is trimmed from the row's caches (``seq_rm``). Only plain ``KVCache``
  layers can drop a suffix; a model with rotating (sliding-window) or recurrent
  cache layers refuses drafts.
* On a Linux CPU the worker binds OpenBLAS over the wheel's reference BLAS
  (:func:`preload_blas`) and dequantizes 4-bit weights to f32 where they fit
  (``SUPERFLUID_MLX_CPU_WEIGHTS=f32|native``): MLX's CPU quantized matmul runs
  at ~1.8 GFLOPS, so SmolLM2 prefilled ~6 tokens/s; f32 over OpenBLAS ~150.
* Sampling runs on the host in numpy, per lane: logit bias, penalties (last
  64 tokens, llama.cpp's rules), then greedy (argmax, first of equal maxima)
  or top-k, top-p, min-p, temperature and a draw from
  ``numpy.random.default_rng(counter_seed(seed, k))`` for generated token
  ``k``, so a re-admitted lane continues the same random stream.
  A grammar (``json``, ``json_schema:…``, GBNF) masks the row after bias and
  penalties, through llguidance (``_guidance.py``): a finished grammar allows only
  the end-of-generation tokens; a token it forbids is refused by ``accept``.
* Log probabilities come from the raw logits (log-softmax).
* Tokenization uses ``tokenizers`` on ``tokenizer.json`` (``parse_special``
  false: control-token text is plain text); pieces are the tokens' bytes.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..proto import MAX_DRAFT_DEPTH, Sampling
from ._engine import BatchRow, ModelInfo, StepAborted, check_sampling_ranges, logprobs_from_logits
from ._executor import counter_seed
from ._guidance import Grammars, HostGrammar

__all__ = ["MemoryFitError", "MlxEngine", "check_model_dir"]

PENALTY_LAST_N = 64
# A prompt pass that may be aborted runs in pieces of ABORT_PIECE tokens, ``abort`` asked between
# them: a piece is as long as a chat that arrives mid-pass may wait. SmolLM2 as f32 on 2 cores
# prefills ~150 tokens/s at position 0 and ~55 at 1,500 (attention), so a piece takes 0.4-1.2 s.
# Smaller pieces cost throughput: a 2,048-token prompt ran at 76-83 tokens/s in pieces of 64, 78-82
# in one pass, 70-73 in pieces of 48, 65-72 of 32, 58-61 in pieces sized to 0.25 s (16 at the end).
ABORT_PIECE = 64
# rows of equal width up to this run as one batched pass (decode rounds and drafting rounds: the
# pending token and at most 15 drafts); wider rows are prompt pieces, run one sequence at a time
MAX_ROUND_WIDTH = MAX_DRAFT_DEPTH + 1
GIB = 1 << 30
STATE_MAGIC = b"SFMLXKV1"   # a sequence state as bytes (_Exported.to_bytes): parks and slot files
TRUST_ENV = "SUPERFLUID_MLX_TRUST_MODEL_CODE"
SKIP_FIT_ENV = "SUPERFLUID_MLX_SKIP_FIT_CHECK"
_NO_MEDIA = "text-only runtime: MLX vision models are not served"
_NO_GRAMMAR = "this runtime has no grammar engine bound (JSON schema and forced tool calls need llama.cpp or MLX)"


class MemoryFitError(RuntimeError):
    """The model's weights would not fit in memory with the required headroom."""


def check_model_dir(path: str) -> dict[str, Any]:
    """The directory's ``config.json``, after the checks that precede any load.

    Raises:
        FileNotFoundError: not an MLX model directory.
        PermissionError: it ships Python code and ``SUPERFLUID_MLX_TRUST_MODEL_CODE`` is not 1.
        MemoryFitError: the weights would not fit (unless ``SUPERFLUID_MLX_SKIP_FIT_CHECK=1``).
    """
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not an MLX model directory (no config.json)")
    shards = glob.glob(str(root / "*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    code = sorted(p.name for p in root.glob("*.py"))
    code += [f"config.json {k}" for k in ("model_file", "auto_map") if k in config]
    if code and os.environ.get(TRUST_ENV) != "1":
        raise PermissionError(f"{path} ships Python code ({', '.join(code)}); set {TRUST_ENV}=1 to run it")
    if os.environ.get(SKIP_FIT_ENV) != "1":
        import psutil

        weights = sum(os.path.getsize(s) for s in shards)
        mem = psutil.virtual_memory()
        need = weights * 1.1 + GIB
        reserve = max(4 * GIB, 0.1 * mem.total)
        if need + reserve > mem.available:
            raise MemoryFitError(
                f"the weights ({weights / GIB:.1f} GiB) need {need / GIB:.1f} GiB and {reserve / GIB:.1f} GiB must "
                f"stay free; {mem.available / GIB:.1f} GiB is available ({SKIP_FIT_ENV}=1 skips this check)")
    return config


BLAS_ENV = "SUPERFLUID_MLX_BLAS"
WEIGHTS_ENV = "SUPERFLUID_MLX_CPU_WEIGHTS"
_OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
             "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
             "/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
             "/usr/lib64/libopenblas.so.0", "/usr/lib/libopenblas.so.0")


_BLAS_LOADED: str | None = None   # what preload_blas bound in this process


def preload_blas() -> str | None:
    """Put an optimised BLAS in front of the one the Linux ``mlx[cpu]`` wheel bundles.

    The wheel links the reference (Netlib) BLAS: a 210x576 by 576x1536 f32 product takes 259 ms
    (1.4 GFLOPS) on this class of machine, and 3.6 ms (104 GFLOPS) with OpenBLAS. Loading OpenBLAS
    with ``RTLD_GLOBAL`` before ``mlx.core`` makes libmlx's ``cblas_*`` calls bind to it (the
    global scope is searched before a library's own dependencies). ``SUPERFLUID_MLX_BLAS``: a path,
    or ``0`` to keep the wheel's. Returns the path loaded, or None. Only on Linux, and only before
    mlx is imported in this process (afterwards the symbols are bound).
    """
    import sys

    global _BLAS_LOADED
    choice = os.environ.get(BLAS_ENV, "")
    if _BLAS_LOADED or choice == "0" or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return _BLAS_LOADED if choice != "0" else None
    import ctypes

    for path in (choice,) if choice else _OPENBLAS:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
            except OSError:
                continue
            _BLAS_LOADED = path
            return path
    return None


def _cpu_weights(cpu: bool, blas: str | None) -> str:
    """``f32`` (dequantize at load) or ``native``: ``SUPERFLUID_MLX_CPU_WEIGHTS``, else f32 on the
    CPU device with an optimised BLAS. MLX's CPU quantized matmul runs at ~1.8 GFLOPS whatever the
    BLAS, so a 4-bit model prefills at ~6 tokens/s there; dequantized with OpenBLAS, ~160."""
    choice = os.environ.get(WEIGHTS_ENV, "")
    if choice not in ("", "f32", "native"):
        raise ValueError(f"{WEIGHTS_ENV} must be f32 or native, not {choice!r}")
    if choice:
        return choice if cpu else "native"
    return "f32" if cpu and blas else "native"


def _dequantize(model: Any, mx: Any) -> str:
    """Every quantized linear and embedding layer as float32, if that fits in memory (else the
    weights stay as they are). Returns what the weights are now."""
    import mlx.nn as nn
    import psutil
    from mlx.utils import tree_unflatten

    quantized = [(name, mod) for name, mod in model.named_modules()
                 if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if not quantized:
        return "native"
    need = sum(mod.weight.size * (32 // mod.bits) * 4 for _, mod in quantized)
    mem = psutil.virtual_memory()
    if need + max(4 * GIB, 0.1 * mem.total) > mem.available:
        return f"native (f32 would need {need / GIB:.1f} GiB)"
    new = []
    for name, mod in quantized:
        w = mx.dequantize(mod.weight, mod.scales, mod.biases, mod.group_size, mod.bits).astype(mx.float32)
        if isinstance(mod, nn.QuantizedEmbedding):
            layer = nn.Embedding(w.shape[0], w.shape[1])
        else:
            layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in mod)
            if "bias" in mod:
                layer.bias = mod.bias
        layer.weight = w
        new.append((name, layer))
    model.update_modules(tree_unflatten(new))
    mx.eval(model.parameters())
    return "f32"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (byte-level BPE token text -> bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class _Vocab:
    """``tokenizer.json`` through ``tokenizers``: ids, pieces, specials."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json")
        self.tok = Tokenizer.from_file(str(path))
        self.plain = Tokenizer.from_file(str(path))
        self.plain.encode_special_tokens = True   # control-token text stays text
        spec = json.loads(path.read_text(encoding="utf-8"))
        decoder = spec.get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
        self.byte_level = "ByteLevel" in kinds
        self.n_vocab = max(self.tok.get_vocab_size(with_added_tokens=True), int(config.get("vocab_size", 0)))
        tconf_path = root / "tokenizer_config.json"
        self.tconf = json.loads(tconf_path.read_text(encoding="utf-8")) if tconf_path.is_file() else {}
        self.specials = {a["content"]: int(a["id"]) for a in spec.get("added_tokens") or () if a.get("special")}
        self._bytes = _byte_decoder()
        self._pieces: dict[int, bytes] = {}

    def token_id(self, text: Any) -> int | None:
        if isinstance(text, dict):
            text = text.get("content")
        return None if text is None else self.tok.token_to_id(text)

    def encode(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        tok = self.tok if parse_special else self.plain
        return list(tok.encode(text, add_special_tokens=add_special).ids)

    def piece(self, token: int) -> bytes:
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token {token} is outside the {self.n_vocab}-token vocabulary")
        text = self.tok.id_to_token(token)
        if text is None:
            out = b""
        elif text in self.specials:
            out = text.encode("utf-8")
        elif self.byte_level:
            out = bytes(self._bytes.get(c, 0x3F) for c in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out = bytes([int(text[3:5], 16)])   # sentencepiece byte fallback
        else:
            out = text.replace("\u2581", " ").encode("utf-8")
        self._pieces[token] = out
        return out


class MlxEngine:
    def __init__(self, model_dir: str, *, max_batch: int, max_context: int, threads: int = 0,
                 deterministic: bool = False) -> None:
        if max_batch < 1 or max_context < 2:
            raise ValueError("max_batch must be >= 1 and max_context >= 2")
        check_model_dir(model_dir)
        blas = preload_blas()
        import mlx.core as mx
        from mlx_lm.utils import load_model

        self._mx = mx
        root = Path(model_dir)
        trust = os.environ.get(TRUST_ENV) == "1"
        self.model, self.config = load_model(root, trust_remote_code=trust)
        cpu = "cpu" in str(mx.default_device()).lower()
        weights = _cpu_weights(cpu, blas)
        if weights == "f32":
            weights = _dequantize(self.model, mx)
        self.vocab = _Vocab(root, self.config)
        n_ctx_train = int(self.config.get("max_position_embeddings") or 0)
        n_ctx_seq = min(max_context, n_ctx_train) if n_ctx_train > 0 else max_context
        n_seq = max(4, max_batch + 2)
        self._caches: list[list[Any]] = [self._new_cache() for _ in range(n_seq)]
        eog = self._eog()
        tconf = self.vocab.tconf
        bos = self.vocab.token_id(tconf.get("bos_token"))
        if bos is None:
            bos = int(self.config.get("bos_token_id") or -1)
        self.deterministic = deterministic
        self.info = ModelInfo(
            name=root.resolve().name, architecture=str(self.config.get("model_type", "unknown")),
            n_vocab=self.vocab.n_vocab, n_ctx_train=n_ctx_train, n_seq=n_seq, n_ctx_seq=n_ctx_seq,
            kv_layout="per_seq", bos=bos, eog=eog, chat_template=str(tconf.get("chat_template") or ""),
            special_tokens=dict(self.vocab.specials), add_bos=bool(tconf.get("add_bos_token", False)),
            extra={"device": str(mx.default_device()), "n_ctx": n_seq * n_ctx_seq, "threads": threads,
                   "deterministic": deterministic, "quantization": self.config.get("quantization"),
                   "blas": blas or "the wheel's own", "weights": weights,
                   "kv_type": f"{mx.default_device()}:{weights}"},   # what a parked state was computed by
        )
        self._eog_set = frozenset(eog)
        self.grammars = Grammars((root / "tokenizer.json").read_text(encoding="utf-8"), self.vocab.n_vocab, eog)
        # A decode round as one batched forward pass, or one pass per lane. Batched is faster on
        # every device measured on a quiet machine: 8 lanes on the CPU took 206 ms a round batched
        # vs 732 ms per lane with f32 weights over OpenBLAS (a step is memory-bound, so rows come
        # almost free) and 1.33 s vs 1.78 s with the 4-bit weights. (An earlier reading of the
        # opposite, 12.0 s vs 7.5 s, was taken at load ~20.) A deterministic worker decodes each
        # lane alone: its logits must not depend on which other lanes share the step.
        default = "0" if deterministic else "1"
        self.batch_decode = os.environ.get("SUPERFLUID_MLX_BATCH_DECODE", default) == "1"
        kinds = sorted({type(c).__name__ for c in self._caches[0]} - {"KVCache"})
        self.drafts: bool | str = True if not kinds else (
            f"this model's {', '.join(kinds)} cache layers cannot drop a rejected draft")
        # --park: a state of plain KVCache layers goes to disk as bytes (_Exported.to_bytes)
        self.parks = not kinds

    def _eog(self) -> tuple[int, ...]:
        ids: set[int] = set()
        eos = self.config.get("eos_token_id")
        for value in eos if isinstance(eos, list) else [eos]:
            if isinstance(value, int):
                ids.add(value)
        for name in (self.vocab.tconf.get("eos_token"), "<|im_end|>", "<|eot_id|>", "<|endoftext|>",
                     "<end_of_turn>"):
            tid = self.vocab.token_id(name)
            if tid is not None:
                ids.add(tid)
        return tuple(sorted(ids))

    def _new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def capabilities(self) -> dict[str, Any]:
        return {
            "sampling": {"greedy": True, "temperature": True, "seed": True, "top_p": True, "top_k": True,
                         "min_p": True, "logit_bias": True, "repeat_penalty": True, "presence_penalty": True,
                         "frequency_penalty": True},
            "logprobs": True,
            "grammar": _grammar_capability(),
            "prefix_cache": True,
            "embeddings": "not an embedding runtime",
            "input": {"text": True, "image": _NO_MEDIA, "audio": _NO_MEDIA},
        }

    # -- vocabulary ----------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.vocab.encode(text, add_special=add_special, parse_special=parse_special)

    def piece(self, token: int) -> bytes:
        return self.vocab.piece(token)

    def is_eog(self, token: int) -> bool:
        return token in self._eog_set

    # -- forward pass ----------------------------------------------------------------

    aborts = True   # a prompt pass runs in pieces, ``abort`` polled between them

    def decode(self, rows: list[BatchRow], abort: Callable[[], bool] | None = None) -> list[Any]:
        mx = self._mx
        for row in rows:
            if not row.tokens:
                raise ValueError(f"an empty batch row for sequence {row.seq}")
            held = self._caches[row.seq][0].offset
            if held != row.pos0:
                raise RuntimeError(f"sequence {row.seq} holds {held} positions; row starts at {row.pos0}")
        width = len(rows[0].tokens)
        if (self.batch_decode and len(rows) > 1 and width <= MAX_ROUND_WIDTH
                and all(len(r.tokens) == width for r in rows)):
            return self._decode_round(rows)
        if abort is not None and any(len(r.tokens) > ABORT_PIECE for r in rows):
            return self._decode_pieces(rows, abort)
        pending: list[tuple[int, Any]] = []
        outs: list[Any] = [None] * len(rows)
        for i, row in enumerate(rows):
            cache = self._caches[row.seq]
            logits = self.model(mx.array([list(row.tokens)]), cache=cache)
            if row.all_logits:
                pending.append((i, logits[0].astype(mx.float32)))
            elif row.want_logits:
                pending.append((i, logits[0, -1, :].astype(mx.float32)))
            else:
                # the cache's arrays still need computing; evaluate them with the rest
                pending.append((-1, cache[-1].keys))
        mx.eval([arr for _, arr in pending])
        for i, arr in pending:
            if i >= 0:
                host = np.array(arr, copy=True)
                outs[i] = list(host) if rows[i].all_logits else host
        return outs

    def _decode_pieces(self, rows: list[BatchRow], abort: Callable[[], bool]) -> list[Any]:
        """The rows in pieces of ``ABORT_PIECE`` tokens, each evaluated before ``abort`` is asked again;
        once it says so, every row's cache goes back to its ``pos0`` and StepAborted."""
        mx = self._mx
        outs: list[Any] = [None] * len(rows)
        try:
            for i, row in enumerate(rows):
                cache = self._caches[row.seq]
                start = 0
                while start < len(row.tokens):
                    if abort():
                        raise StepAborted
                    piece = list(row.tokens[start:start + ABORT_PIECE])
                    logits = self.model(mx.array([piece]), cache=cache)
                    start += len(piece)
                    if row.want_logits and start >= len(row.tokens):
                        last = logits[0, -1, :].astype(mx.float32)
                        mx.eval(last)
                        outs[i] = np.array(last, copy=True)
                    else:
                        mx.eval(cache[-1].keys)
        except StepAborted:
            for row in rows:
                cache = self._caches[row.seq]
                extra = cache[0].offset - row.pos0
                if extra > 0:
                    for c in cache:
                        c.trim(extra)
            raise
        return outs

    def _decode_round(self, rows: list[BatchRow]) -> list[Any]:
        """Rows of equal width (one token each, or a drafting round's pending token and drafts)
        for several sequences in one batched forward pass: each layer's per-sequence caches are
        appended to, then left-padded into one batch; a row's query ``i`` sees its own keys up to
        its own position (padding and later drafts masked out)."""
        mx = self._mx
        width = len(rows[0].tokens)
        per_layer = list(zip(*(self._caches[r.seq] for r in rows), strict=True))
        held = [self._caches[r.seq][0].offset for r in rows]
        lmax = max(held) + width
        key = mx.arange(lmax)[None, None, :]
        first = mx.array([lmax - width - n for n in held])[:, None, None]   # each row's padding ends
        last = (lmax - width + mx.arange(width))[None, :, None]              # query i's own position
        mask = ((key >= first) & (key <= last)).reshape(len(rows), 1, width, lmax)
        offset = mx.array(held)
        views = [_DecodeView(list(caches), offset, mask, lmax, mx) for caches in per_layer]
        logits = self.model(mx.array([list(r.tokens) for r in rows]), cache=views)
        out = logits.astype(mx.float32)
        mx.eval(out)
        host = np.array(out, copy=True)
        return [list(host[i]) if r.all_logits else host[i, -1] if r.want_logits else None
                for i, r in enumerate(rows)]

    def logits(self, out: Any) -> np.ndarray:
        """A decode handle's logits (the handle is the logits)."""
        return out

    # -- sampling ----------------------------------------------------------------------

    def new_sampler(self, sampling: Sampling, history: list[int]) -> _LaneSampler:
        sampler = _LaneSampler(self, sampling)
        for tok in history:
            sampler.accept(tok)
        return sampler

    # -- KV sequences ------------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        cache = self._caches[seq]
        n = cache[0].offset
        if p1 >= 0 and p1 < n:
            return False   # only a suffix can go
        p0 = max(0, p0)
        if p0 == 0:
            self._caches[seq] = self._new_cache()
            return True
        for c in cache:
            c.trim(n - p0)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        mx = self._mx
        source = self._caches[src]
        n = source[0].offset if p1 < 0 else min(p1, source[0].offset)
        fresh = self._new_cache()
        if n > 0:
            for s, d in zip(source, fresh, strict=True):
                d.keys = mx.array(s.keys[..., :n, :])
                d.values = mx.array(s.values[..., :n, :])
                d.offset = n
        self._caches[dst] = fresh

    def seq_export(self, seq: int) -> Any:
        cache = self._caches[seq]
        if cache[0].offset == 0:
            return b""
        return _Exported([(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache],
                         cache[0].offset)

    def seq_import(self, seq: int, data: Any) -> bool:
        """``data``: an export (``_Exported``) or its bytes (``_Exported.to_bytes``: a park or a
        slot file); False (the sequence untouched) for bytes that are not a state of this model's
        layers."""
        mx = self._mx
        fresh = self._new_cache()
        if not isinstance(data, _Exported):
            try:
                data = _Exported.from_bytes(data, mx)
            except (ValueError, TypeError, AttributeError, IndexError, KeyError):
                return False
            if len(data.layers) != len(fresh):
                return False
        for c, (k, v) in zip(fresh, data.layers, strict=True):
            c.keys, c.values, c.offset = mx.array(k), mx.array(v), data.n
        self._caches[seq] = fresh
        return True

    def close(self) -> None:
        self._caches = []


class _DecodeView:
    """One layer's cache for a batched decode round over per-sequence ``KVCache`` s
    (what mlx-lm's attention asks of a cache: ``offset``, ``make_mask``, ``update_and_fetch``)."""

    def __init__(self, caches: list[Any], offset: Any, mask: Any, lmax: int, mx: Any) -> None:
        self.caches, self.offset, self._mask, self._lmax, self._mx = caches, offset, mask, lmax, mx

    def make_mask(self, *_args: Any, **_kw: Any) -> Any:
        return self._mask

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        mx = self._mx
        ks, vs = [], []
        for i, cache in enumerate(self.caches):
            k, v = cache.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            pad = self._lmax - k.shape[2]
            if pad:
                widths = [(0, 0), (0, 0), (pad, 0), (0, 0)]
                k, v = mx.pad(k, widths), mx.pad(v, widths)
            ks.append(k)
            vs.append(v)
        return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)


class _Exported:
    """A sequence's KV held on the host (MLX arrays share storage until written). The host
    cache keeps it as it is; a park or a slot file takes :meth:`to_bytes` (on the engine thread:
    it evaluates the arrays), which :meth:`from_bytes` (``seq_import``) reads back."""

    def __init__(self, layers: list[tuple[Any, Any]], n: int) -> None:
        self.layers = layers
        self.n = n
        self._bytes = sum(k.nbytes + v.nbytes for k, v in layers)

    def __len__(self) -> int:
        return self._bytes

    def to_bytes(self) -> bytearray:
        """``STATE_MAGIC | header length (u32 LE) | header (JSON: n, each array's dtype and shape)
        | each layer's K then V, C order``: one copy of the KV into the buffer."""
        import mlx.core as mx

        arrays = [a for kv in self.layers for a in kv]
        meta = [[str(a.dtype).rsplit(".", 1)[-1], list(a.shape)] for a in arrays]
        header = json.dumps({"n": self.n, "arrays": meta}, separators=(",", ":")).encode()
        start = len(STATE_MAGIC) + 4 + len(header)
        out = bytearray(start + sum(a.nbytes for a in arrays))
        out[:start] = STATE_MAGIC + len(header).to_bytes(4, "little") + header
        target = np.frombuffer(out, np.uint8)
        at = start
        for a in arrays:
            raw = np.asarray(a.view(mx.uint8))   # bfloat16 has no numpy type: its bytes do
            target[at : at + raw.size].reshape(raw.shape)[...] = raw
            at += raw.size
        return out

    @classmethod
    def from_bytes(cls, data: Any, mx: Any) -> _Exported:
        """The arrays :meth:`to_bytes` wrote.

        Raises:
            ValueError: not such bytes (magic, header, sizes, dtypes).
        """
        view = memoryview(data).cast("B")
        if bytes(view[: len(STATE_MAGIC)]) != STATE_MAGIC or len(view) < len(STATE_MAGIC) + 4:
            raise ValueError("not an MLX sequence state")
        n_header = int.from_bytes(view[len(STATE_MAGIC) : len(STATE_MAGIC) + 4], "little")
        at = len(STATE_MAGIC) + 4 + n_header
        header = json.loads(bytes(view[len(STATE_MAGIC) + 4 : at]))
        raw = np.frombuffer(view, np.uint8)
        arrays = []
        for dtype_name, shape in header["arrays"]:
            dtype = getattr(mx, str(dtype_name))
            if not isinstance(dtype, mx.Dtype):
                raise ValueError(f"not a dtype: {dtype_name!r}")
            shape = [int(x) for x in shape]
            nbytes = int(np.prod(shape)) * dtype.size
            if at + nbytes > len(raw) or not shape:
                raise ValueError("a state shorter than its header says")
            arrays.append(mx.array(raw[at : at + nbytes].reshape([*shape[:-1], shape[-1] * dtype.size])).view(dtype))
            at += nbytes
        if at != len(raw) or len(arrays) % 2:
            raise ValueError("a state longer than its header says")
        return cls(list(zip(arrays[::2], arrays[1::2], strict=True)), int(header["n"]))


def _grammar_capability() -> bool | str:
    import importlib.util

    return True if importlib.util.find_spec("llguidance") else "llguidance is not installed (pip install 'superfluid[mlx]')"


class _LaneSampler:
    """One lane's host sampler (see the module docstring). An engine without a ``grammars``
    compiler (baseRT) refuses a grammar."""

    def __init__(self, engine: MlxEngine, sampling: Sampling) -> None:
        check_sampling_ranges(sampling)
        self._grammar: HostGrammar | None = None
        if sampling.grammar:
            grammars = getattr(engine, "grammars", None)
            if grammars is None:
                raise ValueError(_NO_GRAMMAR)
            self._grammar = grammars.compile(sampling.grammar)
        self._engine = engine
        self.s = sampling
        n = engine.info.n_vocab
        for tok, _ in sampling.logit_bias:
            if not 0 <= tok < n:
                raise ValueError(f"logit_bias token {tok} is outside the {n}-token vocabulary")
        self._bias_tokens = np.array([t for t, _b in sampling.logit_bias], dtype=np.int64)
        self._bias_values = np.array([b for _t, b in sampling.logit_bias], dtype=np.float32)
        self._penalize = sampling.repeat_penalty != 1.0 or bool(sampling.presence_penalty or sampling.frequency_penalty)
        self._recent: list[int] = []

    def _adjusted(self, logits: np.ndarray) -> np.ndarray:
        x = logits.copy()
        if len(self._bias_tokens):
            np.add.at(x, self._bias_tokens, self._bias_values)
        if self._penalize and self._recent:
            toks, counts = np.unique(np.array(self._recent[-PENALTY_LAST_N:], dtype=np.int64), return_counts=True)
            vals = x[toks]
            p = self.s.repeat_penalty
            vals = np.where(vals > 0, vals / p, vals * p)
            vals = vals - counts * self.s.frequency_penalty - self.s.presence_penalty
            x[toks] = vals
        return x

    def sample(self, out: Any, k: int) -> int:
        x = self._adjusted(out)
        if self._grammar is not None:
            self._grammar.mask(x)
        if self.s.greedy:
            return int(np.argmax(x))
        return _draw(x, self.s, counter_seed(self.s.seed, k))

    def logprobs(self, out: Any, token: int, n: int) -> list[Any]:
        return logprobs_from_logits(out, token, n, self._engine.piece)

    def accept(self, token: int) -> None:
        if not 0 <= token < self._engine.info.n_vocab:
            raise ValueError(f"token {token} is outside the {self._engine.info.n_vocab}-token vocabulary")
        if self._grammar is not None:
            self._grammar.consume(token)
        if self._penalize:
            self._recent.append(token)
            del self._recent[:-PENALTY_LAST_N]

    def close(self) -> None:
        pass


def _draw(x: np.ndarray, s: Sampling, seed: int) -> int:
    """top-k, top-p, min-p, temperature, then one draw seeded with ``seed``."""
    finite = np.isfinite(x)
    if not finite.any():
        return int(np.argmax(x))
    order = np.argsort(-x, kind="stable")
    order = order[finite[order]]
    if s.top_k > 0:
        order = order[: s.top_k]
    vals = x[order].astype(np.float64)
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    if s.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), s.top_p) + 1)
        order, vals = order[:keep], vals[:keep]
    if s.min_p > 0.0:
        keep = int(np.count_nonzero(np.exp(vals - vals[0]) >= s.min_p))
        order, vals = order[: max(1, keep)], vals[: max(1, keep)]
    scaled = (vals - vals[0]) / max(s.temperature, 1e-6)
    probs = np.exp(scaled)
    probs /= probs.sum()
    rng = np.random.default_rng(seed)
    pick = int(rng.choice(len(order), p=probs)) if len(order) > 1 else 0
    return int(order[pick])


def open_engine(model: str, *, max_batch: int, max_context: int, threads: int,
                deterministic: bool = False) -> MlxEngine:
    """The registry's entry point (``superfluid.runtime``)."""
    return MlxEngine(model, max_batch=max_batch, max_context=max_context, threads=threads,
                     deterministic=deterministic)
