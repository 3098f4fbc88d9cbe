"""What a model needs in memory, from its GGUF header, before a worker loads it.

A small reader of the GGUF metadata section (the key/value pairs before the
tensor table): scalars and strings are kept, arrays are skipped (the
tokenizer's vocabulary is never read into memory) except short numeric ones
(a per-layer ``head_count_kv``). Enough for the memory check of a load
(:func:`memory_need`) and for an embedding context's pooling.

The check: the file's size (its weights, mapped) plus the KV cache the worker
will allocate (``cells × n_layer × (n_embd_k_gqa + n_embd_v_gqa) × 2`` bytes of
f16) must fit in the memory the OS reports available (``psutil``).
``SUPERFLUID_MEMORY_AVAILABLE`` (bytes, or with a K/M/G suffix) pretends
another amount is available: tests, and a cap on a shared machine.
"""

from __future__ import annotations

import functools
import os
import re
import struct
from typing import IO, Any

import attrs

__all__ = ["GgufError", "MemoryNeed", "ModelFacts", "available_memory", "format_bytes", "memory_need", "model_facts",
           "read_metadata"]

MAGIC = b"GGUF"
KV_BYTES_PER_ELEMENT = 2          # llama.cpp's default KV type is f16
MAX_KEYS = 1 << 16
MAX_STRING = 1 << 24              # a metadata string longer than this is a broken file
SHORT_ARRAY = 4096                # numeric arrays up to this many items are kept (per-layer values)
ENV_AVAILABLE = "SUPERFLUID_MEMORY_AVAILABLE"

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """Not a GGUF file, or a broken header."""


def _read(f: IO[bytes], n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufError("truncated GGUF header")
    return data


def _unpack(f: IO[bytes], fmt: str) -> Any:
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: IO[bytes], *, keep: bool = True) -> str:
    n = _unpack(f, "<Q")
    if n > MAX_STRING:
        raise GgufError(f"a {n}-byte metadata string")
    if not keep:
        f.seek(n, os.SEEK_CUR)
        return ""
    return _read(f, n).decode("utf-8", "replace")


def _value(f: IO[bytes], kind: int) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            if count <= SHORT_ARRAY:
                return [_unpack(f, _SCALARS[item]) for _ in range(count)]
            f.seek(size * count, os.SEEK_CUR)
            return None
        if item == _STRING:
            for _ in range(count):
                _string(f, keep=False)
            return None
        if item == _ARRAY:
            raise GgufError("nested metadata arrays are not supported")
        raise GgufError(f"unknown metadata array type {item}")
    raise GgufError(f"unknown metadata type {kind}")


def _header(f: IO[bytes], path: str | os.PathLike[str]) -> tuple[int, dict[str, Any]]:
    """The tensor count and the metadata of the GGUF file ``f`` (read up to its tensor table)."""
    if f.read(4) != MAGIC:
        raise GgufError(f"{path} is not a GGUF file")
    version = _unpack(f, "<I")
    if version not in (2, 3):
        raise GgufError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = _unpack(f, "<Q"), _unpack(f, "<Q")
    if n_kv > MAX_KEYS:
        raise GgufError(f"{n_kv} metadata keys")
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(f)
        out[key] = _value(f, _unpack(f, "<I"))
    return n_tensors, out


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The GGUF file's metadata (long arrays as None). Blocking: call it in a thread.

    Raises:
        GgufError: not a GGUF file, or a broken header.
        OSError: the file cannot be read.
    """
    with open(path, "rb", buffering=1 << 16) as f:
        return _header(f, path)[1]


# -- what a model listing says of a file (Ollama /api/tags details, /v1/models) ---------------------------

# llama.cpp's llama_ftype (general.file_type): the type most of the file's tensors have
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
              36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}
MAX_TENSORS = 1 << 20
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@attrs.frozen(kw_only=True)
class ModelFacts:
    """A model file as a listing describes it; what could not be read is empty."""

    size: int = 0                   # bytes on disk, every part of a split file
    format: str = ""                # gguf, safetensors (an MLX directory), base
    family: str = ""                # general.architecture
    parameters: int = 0             # elements of every tensor
    quantization_level: str = ""    # Q4_K_M, F16, ...
    context_length: int = 0         # trained
    modified: float = 0.0           # the file's mtime

    @property
    def parameter_size(self) -> str:
        """Ollama's form of the parameter count: 135M, 134.52M, 8B, 7.6B."""
        n = self.parameters
        for unit, scale, places in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
            if n >= scale:
                value = n / scale
                return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{places}f}{unit}"
        return str(n) if n else ""


def _tensor_elements(f: IO[bytes], n_tensors: int) -> int:
    if n_tensors > MAX_TENSORS:
        raise GgufError(f"{n_tensors} tensors")
    total = 0
    for _ in range(n_tensors):
        _string(f, keep=False)
        n_dims = _unpack(f, "<I")
        if n_dims > 8:
            raise GgufError(f"a tensor of {n_dims} dimensions")
        count = 1
        for _ in range(n_dims):
            count *= _unpack(f, "<Q")
        f.seek(12, os.SEEK_CUR)  # type (u32), offset (u64)
        total += count
    return total


def _parts(path: str) -> list[str]:
    """A split GGUF's parts (from its first), else the file alone."""
    m = _SPLIT.search(path)
    if m is None or int(m.group(1)) != 1:
        return [path]
    stem, total = path[: m.start()], int(m.group(2))
    return [f"{stem}-{i:05d}-of-{total:05d}{path[m.end() - 5:]}" for i in range(1, total + 1)]


@functools.lru_cache(maxsize=256)
def _facts(path: str, _size: int, _mtime_ns: int) -> ModelFacts:
    if os.path.isdir(path):
        size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        return ModelFacts(size=size, format="safetensors", modified=os.path.getmtime(path))
    if not path.lower().endswith(".gguf") and not _is_gguf(path):
        return ModelFacts(size=os.path.getsize(path), format="base" if path.endswith(".base") else "",
                          modified=os.path.getmtime(path))
    meta: dict[str, Any] = {}
    size = elements = 0
    for i, part in enumerate(_parts(path)):
        size += os.path.getsize(part)
        with open(part, "rb", buffering=1 << 16) as f:
            n_tensors, part_meta = _header(f, part)
            elements += _tensor_elements(f, n_tensors)
        meta = meta if i else part_meta
    arch = str(meta.get("general.architecture", ""))
    ftype = meta.get("general.file_type")
    return ModelFacts(size=size, format="gguf", family=arch, parameters=elements,
                      quantization_level=FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
                      context_length=int(meta.get(f"{arch}.context_length", 0) or 0),
                      modified=os.path.getmtime(path))


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def model_facts(path: str | os.PathLike[str]) -> ModelFacts:
    """What a listing says of the model at ``path`` (a GGUF file, an MLX directory, a bundle):
    read once per version of the file. Blocking: call it in a thread. A file that cannot be
    read, or a broken header, gives what is known (the size, at least, when it exists)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        return _facts(real, st.st_size, st.st_mtime_ns)
    except (OSError, GgufError, struct.error):
        try:
            return ModelFacts(size=os.path.getsize(real), modified=os.path.getmtime(real))
        except OSError:
            return ModelFacts()


@attrs.frozen(kw_only=True)
class MemoryNeed:
    weights: int            # bytes of the file
    kv: int                 # bytes of KV cache the worker allocates
    cells: int
    n_layer: int
    n_embd: int             # the embedding width (an embedding's dimension)
    pooling: str | None     # the GGUF's pooling type for embeddings, None if it names none

    @property
    def total(self) -> int:
        return self.weights + self.kv


_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _per_layer(value: Any, n_layer: int) -> int:
    if isinstance(value, list):  # a per-layer value: the largest layer bounds the cache
        return max((int(v) for v in value[:n_layer]), default=0)
    return int(value or 0)


def memory_need(path: str | os.PathLike[str], *, n_seq: int, n_ctx_seq: int) -> MemoryNeed:
    """Weights and KV cache of a llama.cpp load of ``path`` with ``n_seq`` sequences of
    ``n_ctx_seq`` tokens (capped by the model's trained context), as the engine sizes it.

    Raises:
        GgufError: not a GGUF file, or a broken header.
        OSError: the file cannot be read.
    """
    meta = read_metadata(path)
    arch = str(meta.get("general.architecture", ""))

    def get(key: str, default: Any = 0) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_layer = int(get("block_count"))
    n_embd = int(get("embedding_length"))
    n_head = _per_layer(get("attention.head_count"), n_layer)
    n_head_kv = _per_layer(get("attention.head_count_kv", None), n_layer) or n_head
    head_dim = n_embd // n_head if n_head else 0
    k_len = int(get("attention.key_length", head_dim) or head_dim)
    v_len = int(get("attention.value_length", head_dim) or head_dim)
    trained = int(get("context_length"))
    ctx = min(n_ctx_seq, trained) if trained > 0 else n_ctx_seq
    cells = n_seq * ctx
    kv = cells * n_layer * (k_len + v_len) * n_head_kv * KV_BYTES_PER_ELEMENT
    pooling = get("pooling_type", None)
    return MemoryNeed(weights=os.path.getsize(path), kv=kv, cells=cells, n_layer=n_layer, n_embd=n_embd,
                      pooling=_POOLING.get(pooling) if isinstance(pooling, int) else None)


def _parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    return int(float(number) * scale)


def available_memory(environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[int, str]:
    """Bytes of memory available for a new model, and where the number comes from.

    Raises:
        ValueError: ``SUPERFLUID_MEMORY_AVAILABLE`` is not a size.
    """
    pretend = environ.get(ENV_AVAILABLE)
    if pretend:
        try:
            return _parse_bytes(pretend), f"${ENV_AVAILABLE}"
        except ValueError:
            raise ValueError(f"${ENV_AVAILABLE}={pretend!r} is not a size (bytes, or with K/M/G)") from None
    import psutil

    return int(psutil.virtual_memory().available), "available memory"


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
