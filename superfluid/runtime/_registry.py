"""Every runtime superfluid knows, in one table.

A runtime is one :class:`RuntimeInfo` record here plus its worker engine module
(``superfluid/worker/_<id>.py``, which exports ``open_engine``). Everything else
(the worker's ``load_engine``, model resolution, ``/v1/models/load``, ``serve`` and
``superfluid runtimes``) reads this table. The daemon never imports a runtime
library: ``engine`` is a module path the *worker* imports, and ``requires`` names
the Python modules the worker's environment must hold.

This module imports nothing but the standard library: the worker process reads it too.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "FORMAT_WORDS", "Package", "PythonSource", "RUNTIMES", "RuntimeInfo", "UnknownRuntime", "detect", "detect_format",
    "get", "ids", "mismatch", "register", "resolve",
]

GGUF_MAGIC = b"GGUF"
BASE_MAGIC = b"BASE"

# what a format is called in a sentence ("it reads a GGUF file, and this is a .base bundle")
FORMAT_WORDS = {
    "gguf": "a GGUF file",
    "mlx": "an MLX directory",
    "base": "a .base bundle",
    "mock": "a mock spec",
}


class UnknownRuntime(ValueError):
    """A runtime id that is no runtime's id or alias."""


@dataclass(frozen=True)
class Package:
    """One pinned distribution of a Python runtime's environment."""

    name: str
    version: str
    sha256: tuple[str, ...]   # every artifact pip may pick (wheels per platform, the sdist)
    binary: bool = True       # a wheel exists: installed --only-binary

    def requirement(self) -> str:
        hashes = " ".join(f"--hash=sha256:{h}" for h in self.sha256)
        return f"{self.name}=={self.version} {hashes}"


@dataclass(frozen=True)
class PythonSource:
    """A runtime installed as a private virtual environment of pinned packages."""

    version: str                        # the tested version of the runtime's main package
    packages: tuple[Package, ...]
    index: str = "https://pypi.org/simple"
    backends: tuple[str, ...] = ("cpu",)
    # backend -> environment for a source build of it (CMAKE_ARGS for llama-cpp-python)
    build_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeInfo:
    id: str
    aliases: tuple[str, ...]
    engine: str | None                  # worker engine module (exports open_engine); None: no engine in this build
    formats: tuple[str, ...]            # format ids (FORMAT_WORDS) it reads
    requires: tuple[str, ...] = ()      # Python modules the worker's environment must import
    builtin: bool = False               # ships with superfluid; nothing to install
    source: PythonSource | None = None  # how `runtime install` builds it without --from
    platforms: Callable[[], str | None] = lambda: None  # why this machine cannot run it, or None
    native: Callable[[], str | None] = lambda: None     # why its native library is absent here, or None
    capabilities: Mapping[str, bool | str] = field(default_factory=dict)
    summary: str = ""

    @property
    def format_words(self) -> str:
        return ", ".join(FORMAT_WORDS[f] for f in self.formats)


def _basert_platform() -> str | None:
    here = (sys.platform, platform.machine())
    if here in (("darwin", "arm64"), ("linux", "aarch64")):
        return None
    return f"ships engines for macos-arm64 and linux-arm64-cuda only; this machine is {here[0]} {here[1]}"


def _basert_library() -> str | None:
    lib = os.environ.get("BASERT_LIB", "")
    if lib and os.path.isfile(lib):
        return None
    return f"no libbasert at BASERT_LIB={lib}" if lib else "libbasert not found: BASERT_LIB is not set"


_LLAMACPP_SOURCE = PythonSource(
    version="0.3.36",
    packages=(
        # no wheel on PyPI: built from the sdist (pip's wheel cache keeps the build)
        Package("llama-cpp-python", "0.3.36",
                ("832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",), binary=False),
        Package("numpy", "2.4.6", ("89cd468399cfd2504718f0ba50e410dca55a170b61a02ad92bb18c8a65186e93",)),
        Package("diskcache", "5.6.3", ("5e31b2d5fbad117cc363ebaf6b689474db18a1f6438bc82358b024abd4c2ca19",)),
        Package("jinja2", "3.1.6", ("85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67",)),
        Package("markupsafe", "3.0.4", ("6da83a088f8ef93b2d483a8232a4dbf4d69d3d8496b568a03c56becac43e1808",)),
        Package("typing-extensions", "4.16.0",
                ("481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8",)),
    ),
    backends=("cpu", "cuda", "vulkan"),
    build_env={"cuda": {"CMAKE_ARGS": "-DGGML_CUDA=on"}, "vulkan": {"CMAKE_ARGS": "-DGGML_VULKAN=on"}},
)

_PRIMITIVE = {"continuous_batching": True, "prefix_cache": True, "grammars": True,
              "park_lossy": "a primitive runtime exports no lossy encoding", "media": "no media path"}

RUNTIMES: dict[str, RuntimeInfo] = {}


def register(info: RuntimeInfo) -> RuntimeInfo:
    """Add a runtime (tests add toy ones). Its id and aliases must be new."""
    for name in (info.id, *info.aliases):
        if _lookup(name) is not None:
            raise ValueError(f"runtime name {name!r} is taken")
    RUNTIMES[info.id] = info
    return info


def _lookup(name: str) -> RuntimeInfo | None:
    name = name.lower()
    for info in RUNTIMES.values():
        if name == info.id or name in info.aliases:
            return info
    return None


register(RuntimeInfo(
    id="llamacpp", aliases=("llama.cpp", "llama-cpp"), engine="superfluid.worker._llamacpp", formats=("gguf",),
    requires=("llama_cpp", "numpy"), source=_LLAMACPP_SOURCE, capabilities=_PRIMITIVE,
    summary="llama.cpp through llama-cpp-python",
))
register(RuntimeInfo(
    id="mlx", aliases=(), engine="superfluid.worker._mlx", formats=("mlx",), requires=("mlx.core", "mlx_lm"),
    capabilities=_PRIMITIVE, summary="Apple's MLX with mlx-lm",
))
register(RuntimeInfo(
    id="basert", aliases=("native",), engine="superfluid.worker._basert", formats=("base",), platforms=_basert_platform,
    native=_basert_library,
    capabilities={"continuous_batching": True, "prefix_cache": True},
    summary="the baseRT engine library (a full engine); install with --from URL --sha256 H",
))
register(RuntimeInfo(
    id="mock", aliases=(), engine="superfluid.worker._mock", formats=("mock",), builtin=True,
    capabilities={"continuous_batching": True, "prefix_cache": True, "grammars": "the mock has no grammar"},
    summary="the built-in deterministic test engine",
))


def ids() -> tuple[str, ...]:
    return tuple(RUNTIMES)


def get(name: str) -> RuntimeInfo:
    """The runtime named by ``name`` (an id or an alias, any case).

    Raises:
        UnknownRuntime: with a one-line message listing the known ids.
    """
    info = _lookup(name)
    if info is None:
        raise UnknownRuntime(f"unknown runtime {name!r} (known: {', '.join(RUNTIMES)})")
    return info


def detect_format(spec: str | os.PathLike[str]) -> str | None:
    """The format of a model argument: ``gguf``, ``mlx``, ``base``, ``mock``, or None.

    A mock spec is ``mock`` or ``mock?...``. A file is read for its magic (``GGUF``, ``BASE``);
    a missing file is judged by its extension. A directory holding ``config.json`` and
    ``*.safetensors`` is MLX; a directory ending ``.base`` is a bundle.
    """
    text = os.fspath(spec)
    if text == "mock" or text.startswith("mock?"):
        return "mock"
    path = Path(text)
    try:
        if path.is_dir():
            if path.suffix == ".base":
                return "base"
            if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
                return "mlx"
            return None
        magic = b""
        if path.is_file():
            with open(path, "rb") as f:
                magic = f.read(4)
        elif path.exists():  # a FIFO or a device: never opened (a read may block or never end)
            return None
    except (OSError, ValueError):  # unreadable, or a name no file system takes (a NUL byte)
        return None
    if magic == GGUF_MAGIC:
        return "gguf"
    if magic == BASE_MAGIC:
        return "base"
    if magic:  # a file with another magic is neither, whatever its name says
        return None
    return {".gguf": "gguf", ".base": "base"}.get(path.suffix.lower())


def detect(spec: str | os.PathLike[str]) -> RuntimeInfo | None:
    """The runtime that reads the model ``spec`` (by format), or None."""
    fmt = detect_format(spec)
    if fmt is None:
        return None
    return next((info for info in RUNTIMES.values() if fmt in info.formats), None)


def mismatch(info: RuntimeInfo, spec: str) -> str | None:
    """Why ``info`` cannot serve ``spec`` (one sentence with what to do), or None if it can."""
    fmt = detect_format(spec)
    if fmt is None or fmt in info.formats:
        return None
    name = Path(spec).name if fmt != "mock" else spec
    right = detect(spec)
    fix = f"pass --runtime {right.id}, or convert the model" if right else "convert the model"
    return (f"runtime {info.id} cannot serve {name}: it reads {info.format_words}, and this is "
            f"{FORMAT_WORDS[fmt]} ({fix})")


def resolve(spec: str, requested: str | None) -> RuntimeInfo:
    """The runtime for model ``spec``: ``requested`` (an id or alias; ``auto``/None: by format).

    A model of no known format goes to llama.cpp, which says what it cannot read at load.

    Raises:
        UnknownRuntime: ``requested`` names no runtime.
    """
    if requested and requested.lower() != "auto":
        return get(requested)
    found = detect(spec)
    return found if found is not None else RUNTIMES["llamacpp"]
