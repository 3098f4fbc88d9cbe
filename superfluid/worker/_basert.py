"""The baseRT loader: ``.base`` bundles through ``libbasert`` over ctypes.

baseRT is a full engine; this worker binds the few entry points a primitive
runtime needs, so the generic executor drives it like llama.cpp and MLX:

=====================================  ===============================================
``int basert_abi_version(void)``       must equal :data:`ABI_VERSION`
``void *basert_open(const char *path, int n_seq, int n_ctx, char *err, size_t cap)``
                                       a loaded bundle, or NULL with a reason in ``err``
``int basert_n_vocab(void *)``         vocabulary size
``int basert_n_ctx_train(void *)``     trained context window
``int basert_eos(void *)``             end-of-generation token id
``int basert_tokenize(void *, const char *text, int32_t *out, int cap)``
                                       token count (negative: ``-needed`` if ``cap`` is short)
``int basert_piece(void *, int32_t tok, char *out, int cap)``
                                       bytes written (negative: ``-needed``)
``int basert_decode(void *, int seq, int pos0, const int32_t *tokens, int n, float *logits)``
                                       runs ``tokens`` into ``seq`` at ``pos0``; writes the
                                       last position's ``n_vocab`` logits; 0 on success
``int basert_seq_rm(void *, int seq, int p0)``   drops positions ``>= p0``; 0 on success
``int basert_seq_cp(void *, int src, int dst, int n)``  ``dst`` := ``src``'s first ``n``; 0 on success
``void basert_close(void *)``
=====================================  ===============================================

The library comes from ``--basert-lib``, else ``BASERT_LIB``; without either
(or with a path that does not exist) loading a bundle fails with
:class:`BaseRTMissing`, whose message names the fix. No baseRT build exists
for this machine: the tests exercise this layer against a small C library
they compile, implementing the entry points above.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..proto import Sampling
from ._engine import BatchRow, ModelInfo

__all__ = ["ABI_VERSION", "BaseRTEngine", "BaseRTMissing", "find_library", "load_basert"]

ABI_VERSION = 1
LIB_ENV = "BASERT_LIB"
FIX = f"install baseRT and pass --basert-lib /path/to/libbasert.so (or set {LIB_ENV})"


class BaseRTMissing(RuntimeError):
    """No usable libbasert."""


def find_library(explicit: str | None = None) -> str:
    """The libbasert path to load.

    Raises:
        BaseRTMissing: none given, or the given one does not exist.
    """
    path = explicit or os.environ.get(LIB_ENV) or ""
    if not path:
        raise BaseRTMissing(f".base bundles need the baseRT library, which is not installed: {FIX}")
    if not Path(path).is_file():
        raise BaseRTMissing(f"no baseRT library at {path}: {FIX}")
    return path


_I = ctypes.c_int
_P = ctypes.c_void_p
_I32P = ctypes.POINTER(ctypes.c_int32)
_SIGS: dict[str, tuple[Any, list[Any]]] = {
    "basert_abi_version": (_I, []),
    "basert_open": (_P, [ctypes.c_char_p, _I, _I, ctypes.c_char_p, ctypes.c_size_t]),
    "basert_n_vocab": (_I, [_P]),
    "basert_n_ctx_train": (_I, [_P]),
    "basert_eos": (_I, [_P]),
    "basert_tokenize": (_I, [_P, ctypes.c_char_p, _I32P, _I]),
    "basert_piece": (_I, [_P, ctypes.c_int32, ctypes.c_char_p, _I]),
    "basert_decode": (_I, [_P, _I, _I, _I32P, _I, ctypes.POINTER(ctypes.c_float)]),
    "basert_seq_rm": (_I, [_P, _I, _I]),
    "basert_seq_cp": (_I, [_P, _I, _I, _I]),
    "basert_close": (None, [_P]),
}


def bind(path: str) -> ctypes.CDLL:
    """Load ``path`` and declare every entry point.

    Raises:
        BaseRTMissing: the library cannot be loaded, lacks an entry point, or speaks another ABI.
    """
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise BaseRTMissing(f"cannot load the baseRT library {path}: {exc}") from None
    for name, (res, args) in _SIGS.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise BaseRTMissing(f"{path} is not a baseRT library (no {name})") from None
        fn.restype = res
        fn.argtypes = args
    abi = lib.basert_abi_version()
    if abi != ABI_VERSION:
        raise BaseRTMissing(f"{path} speaks baseRT ABI {abi}; this worker needs {ABI_VERSION}")
    return lib


class BaseRTEngine:
    """A primitive engine over libbasert (host sampling: greedy and seeded draws via the MLX sampler)."""

    def __init__(self, bundle: str, lib_path: str, *, max_batch: int, max_context: int) -> None:
        self.lib = bind(lib_path)
        n_seq = max(4, max_batch + 2)
        err = ctypes.create_string_buffer(512)
        self.h = self.lib.basert_open(bundle.encode(), n_seq, max_context, err, len(err))
        if not self.h:
            raise RuntimeError(f"baseRT could not open {bundle}: {err.value.decode('utf-8', 'replace')}")
        self.n_vocab = self.lib.basert_n_vocab(self.h)
        n_ctx_train = self.lib.basert_n_ctx_train(self.h)
        eos = self.lib.basert_eos(self.h)
        self._logits = (ctypes.c_float * self.n_vocab)()
        self._pos = [0] * n_seq
        self.info = ModelInfo(
            name=Path(bundle).name.removesuffix(".base"), architecture="basert", n_vocab=self.n_vocab,
            n_ctx_train=n_ctx_train, n_seq=n_seq, n_ctx_seq=min(max_context, n_ctx_train or max_context),
            kv_layout="per_seq", bos=-1, eog=(eos,), chat_template="", special_tokens={}, add_bos=False,
            extra={"library": lib_path},
        )

    def capabilities(self) -> dict[str, Any]:
        return {"sampling": {"greedy": True, "temperature": True, "seed": True}, "logprobs": True,
                "grammar": "not bound for baseRT", "prefix_cache": True,
                "embeddings": "not bound", "input": {"text": True, "image": "not bound", "audio": "not bound"}}

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            buf = (ctypes.c_int32 * cap)()
            n = self.lib.basert_tokenize(self.h, data, buf, cap)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def piece(self, token: int) -> bytes:
        cap = 32
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = self.lib.basert_piece(self.h, token, buf, cap)
            if n >= 0:
                return buf.raw[:n]
            cap = -n

    def is_eog(self, token: int) -> bool:
        return token in self.info.eog

    aborts = False   # a pass runs to its end
    drafts = "the basert engine drafts with its own strategies, which superfluid does not drive yet"

    def decode(self, rows: list[BatchRow]) -> list[Any]:
        outs: list[Any] = []
        for row in rows:
            toks = (ctypes.c_int32 * len(row.tokens))(*row.tokens)
            rc = self.lib.basert_decode(self.h, row.seq, row.pos0, toks, len(row.tokens), self._logits)
            if rc != 0:
                raise RuntimeError(f"basert_decode returned {rc}")
            self._pos[row.seq] = row.pos0 + len(row.tokens)
            outs.append(np.ctypeslib.as_array(self._logits).copy() if row.want_logits else None)
        return outs

    def new_sampler(self, sampling: Sampling, history: list[int]) -> Any:
        from ._mlx import _LaneSampler   # numpy-only host sampler; importing it does not load mlx

        sampler = _LaneSampler(self, sampling)  # type: ignore[arg-type]
        for tok in history:
            sampler.accept(tok)
        return sampler

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        if p1 >= 0:
            return False
        return self.lib.basert_seq_rm(self.h, seq, max(0, p0)) == 0

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if self.lib.basert_seq_cp(self.h, src, dst, p1) != 0:
            raise RuntimeError(f"basert_seq_cp({src} -> {dst}) failed")

    def seq_export(self, seq: int) -> Any:
        return b""

    def seq_import(self, seq: int, data: Any) -> bool:
        return False

    def close(self) -> None:
        if self.h:
            self.lib.basert_close(self.h)
            self.h = None


def load_basert(bundle: str, *, max_batch: int, max_context: int, lib: str | None = None) -> BaseRTEngine:
    """Raises BaseRTMissing (no library) or RuntimeError (the bundle did not open)."""
    return BaseRTEngine(bundle, find_library(lib), max_batch=max_batch, max_context=max_context)


def open_engine(model: str, *, max_batch: int, max_context: int, threads: int, deterministic: bool = False,
                lib: str | None = None) -> BaseRTEngine:
    """The registry's entry point (``superfluid.runtime``): the library from ``lib``, else ``BASERT_LIB``."""
    return load_basert(model, max_batch=max_batch, max_context=max_context, lib=lib)
