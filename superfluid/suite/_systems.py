"""Systems under test: what each one is, how it is started, what it can do.

A system is an argv template plus capabilities. Built in: ``superfluid-mock``
(the mock runtime, no files needed), ``superfluid-llamacpp`` (a GGUF from the
box file, else the cached default model) and ``llama-server`` (binary and
library dir from the box file). A box file may add ``extra_systems``.

Box file (JSON; relative paths are taken from ``root``, default the file's
folder)::

    {"box": "laptop", "root": ".", "superfluid": "bin/superfluid",
     "superfluid_home": "home", "llama_server": "bin/llama-server",
     "llama_lib": "lib", "lib_env": "LD_LIBRARY_PATH", "llama_args": ["-t", "2"],
     "superfluid_args": ["--deterministic"],
     "models": {"gguf": "models/m.gguf", "small_gguf": "models/small.gguf",
                "mock": "mock?step_ms=3"},
     "versions": {"llama.cpp": "b1234"}, "ports": {"llama-server": 18611},
     "extra_systems": {"name": {"argv": ["{root}/srv", "--port", "{port}"],
        "env": {}, "probe": "/v1/models", "port": 18620, "worker": "pattern",
        "model_id": "m", "qos": false, "busy": "slots", "unload": null,
        "resume": false}}}

Placeholders: ``{python} {root} {run_dir} {name} {port} {lanes} {ctx}
{kv_tokens} {gguf} {small_gguf} {model}``.

Equal memory: ``{kv_tokens}`` is :func:`kv_cells`, the KV cells a superfluid
worker allocates for ``lanes`` x ``ctx``, so llama-server gets as many (``-c
{kv_tokens} -np {lanes}``); neither keeps prompts in host memory (superfluid
``--host-cache-mb 0``, llama-server ``--cache-ram 0``; their defaults are 2 and 8 GiB).
``superfluid_args`` and ``llama_args`` are appended to every superfluid and
llama-server command line; the manifest records each system's argv.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path
from typing import Any

import attrs

__all__ = ["Box", "Caps", "SystemSpec", "attached_spec", "kv_cells", "load_box", "model_id_guess", "render_argv",
           "system_spec"]

MOCK_COMPANION = "mock?name=mock-companion&eos_every=100000"
DEFAULT_PORTS = {"superfluid-mock": 18600, "superfluid-llamacpp": 18601, "superfluid-mlx": 18602,
                 "llama-server": 18611, "mlx-lm-server": 18612, "ollama": 18613}


@attrs.frozen
class Caps:
    family: str                        # "superfluid" | "llama-server" | "other"
    worker_pattern: str | None = None  # command-line substring of a separate inference worker
    unload: str | None = None          # "openai-models-unload" when POST /v1/models/unload exists
    qos_header: bool = False           # takes x-superfluid-qos
    busy: str | None = None            # "metrics" (superfluid_lanes_active) | "slots" (llama-server) | None
    resume: bool = False               # GET /v1/sessions/{id}/stream resumes an x-superfluid-resumable stream


@attrs.frozen
class SystemSpec:
    name: str
    argv: tuple[str, ...]
    caps: Caps
    port: int
    probe: str = "/health"
    env: dict[str, str] = attrs.field(factory=dict)
    model: str | None = None            # the {model} placeholder: a path or a mock spec
    companion: str | None = None        # a second, small model (unload_reload on superfluid)
    model_id: str | None = None
    runtime: str | None = None
    sessions: bool = False              # has a state dir at {run_dir}/sess-{name}


@attrs.frozen
class Box:
    name: str
    root: Path
    data: dict[str, Any]

    def path(self, key: str, *, models: bool = False) -> str | None:
        value = (self.data.get("models") or {}).get(key) if models else self.data.get(key)
        if not value:
            return None
        p = Path(value)
        return str(p if p.is_absolute() else self.root / p)

    @property
    def versions(self) -> dict[str, Any]:
        return dict(self.data.get("versions") or {})


def load_box(path: str | None) -> Box:
    if path is None:
        return Box(name="local", root=Path.cwd(), data={})
    file = Path(path)
    data = json.loads(file.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a box file is a JSON object")
    root = Path(data.get("root") or ".")
    root = root if root.is_absolute() else (file.parent / root).resolve()
    return Box(name=str(data.get("box") or file.stem), root=root, data=data)


def render_argv(template: tuple[str, ...] | list[str], values: dict[str, Any]) -> list[str]:
    """Fill placeholders; an unknown one is an error naming it."""
    out = []
    for part in template:
        names = [f for _, f, _, _ in string.Formatter().parse(part) if f]
        missing = [n for n in names if values.get(n) is None]
        if missing:
            raise ValueError(f"argv template {part!r} needs {', '.join(missing)}, which this box does not give")
        out.append(part.format_map(values))
    return out


def kv_cells(lanes: int, ctx: int) -> int:
    """KV cells a superfluid worker allocates: ``max(4, lanes + 2)`` sequences of ``ctx``
    cells (superfluid/worker/_llamacpp.py and _main.py size it so; the spare sequences hold
    cached prefixes)."""
    return max(4, lanes + 2) * ctx


def _port(box: Box, name: str, default: int) -> int:
    return int((box.data.get("ports") or {}).get(name, default))


def _superfluid(box: Box, name: str, runtime: str, model: str | None, companion: str | None) -> SystemSpec:
    binary = box.path("superfluid")
    head = [binary, "serve"] if binary else [sys.executable, "-m", "superfluid", "serve"]
    # an MLX model's companion (a GGUF) keeps its own runtime: the directive names the model
    selector = runtime if runtime in ("mock", "llamacpp") else "{model}=" + runtime
    argv = (*head, "{model}", "--runtime", selector, "--http", "127.0.0.1:{port}", "--max-batch", "{lanes}",
            "--max-context", "{ctx}", "--sessions", "{run_dir}/sess-{name}", "--host-cache-mb", "0", "--no-tui",
            *[str(a) for a in box.data.get("superfluid_args") or []])
    env = {}
    if box.path("superfluid_home"):
        env["SUPERFLUID_HOME"] = str(box.path("superfluid_home"))
    caps = Caps(family="superfluid", worker_pattern=f"superfluid-worker-{runtime}", unload="openai-models-unload",
                qos_header=True, busy="metrics", resume=True)
    return SystemSpec(name=name, argv=argv, caps=caps, port=_port(box, name, DEFAULT_PORTS.get(name, 18600)),
                      env=env, model=model, companion=companion, runtime=runtime, sessions=True)


def model_id_guess(spec: str) -> str:
    """The id a superfluid daemon gives a model spec: a mock's ``name`` option, else the file name sans .gguf."""
    if spec == "mock" or spec.startswith("mock?"):
        from urllib.parse import parse_qsl

        return dict(parse_qsl(spec.partition("?")[2])).get("name", "mock")
    name = Path(spec).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def _default_gguf() -> str | None:
    try:
        from ..models._files import default_model_path

        return str(default_model_path(fetch=False))
    except (FileNotFoundError, ImportError):
        return None


def _default_mlx() -> str | None:
    try:
        from ..models._mlx_convert import mlx_test_model_path

        return str(mlx_test_model_path(build=False))
    except (FileNotFoundError, ImportError):
        return None


def system_spec(name: str, box: Box, *, mock_spec: str) -> SystemSpec:
    """The named system on this box.

    Raises:
        ValueError: unknown system, or the box lacks what it needs.
    """
    if name == "superfluid-mock":
        models = box.data.get("models") or {}
        return _superfluid(box, name, "mock", models.get("mock") or mock_spec,
                           models.get("mock_companion") or MOCK_COMPANION)
    if name == "superfluid-llamacpp":
        gguf = box.path("gguf", models=True) or _default_gguf()
        if gguf is None:
            raise ValueError("superfluid-llamacpp needs models.gguf in the box file (no cached default model)")
        return _superfluid(box, name, "llamacpp", gguf, box.path("small_gguf", models=True))
    if name == "superfluid-mlx":
        return _superfluid(box, name, "mlx", box.path("mlx", models=True) or _default_mlx(),
                           box.path("small_gguf", models=True))
    if name == "mlx-lm-server":
        # the same mlx-lm's own server; "mlx_server_model" may name an f32 copy of the directory (equal
        # compute to ours on a Linux CPU, where superfluid runs 4-bit layers as f32 over OpenBLAS)
        model = box.path("mlx_server_model", models=True) or box.path("mlx", models=True) or _default_mlx()
        argv = (sys.executable, "-m", "mlx_lm", "server", "--model", "{model}", "--host", "127.0.0.1", "--port",
                "{port}", "--decode-concurrency", "{lanes}", "--prompt-concurrency", "{lanes}",
                *[str(a) for a in box.data.get("mlx_server_args") or []])
        env = {k: str(v) for k, v in (box.data.get("mlx_server_env") or {}).items()}
        return SystemSpec(name=name, argv=argv, caps=Caps(family="other"), port=_port(box, name, DEFAULT_PORTS[name]),
                          env=env, model=model, model_id="default_model", probe="/health")
    if name == "llama-server":
        binary = box.path("llama_server")
        gguf = box.path("gguf", models=True) or _default_gguf()
        if binary is None or gguf is None:
            raise ValueError("llama-server needs llama_server and models.gguf in the box file")
        argv = (binary, "-m", "{gguf}", "-c", "{kv_tokens}", "-np", "{lanes}", "--cache-ram", "0", "--metrics", "--jinja",
                *[str(a) for a in box.data.get("llama_args") or []], "--host", "127.0.0.1", "--port", "{port}")
        env = {}
        if box.path("llama_lib"):
            env[str(box.data.get("lib_env") or "LD_LIBRARY_PATH")] = str(box.path("llama_lib"))
        return SystemSpec(name=name, argv=argv, caps=Caps(family="llama-server", busy="slots"),
                          port=_port(box, name, DEFAULT_PORTS["llama-server"]), env=env, model=gguf)
    extras = box.data.get("extra_systems") or {}
    if name in extras:
        spec = extras[name]
        i = list(extras).index(name)
        caps = Caps(family=str(spec.get("family", "other")), worker_pattern=spec.get("worker"),
                    unload=spec.get("unload"), qos_header=bool(spec.get("qos", False)), busy=spec.get("busy"),
                    resume=bool(spec.get("resume", False)))
        return SystemSpec(name=name, argv=tuple(spec["argv"]), caps=caps, port=int(spec.get("port", 18620 + i)),
                          probe=str(spec.get("probe", "/v1/models")), env=dict(spec.get("env") or {}),
                          model=box.path("gguf", models=True), model_id=spec.get("model_id"))
    known = ["superfluid-mock", "superfluid-llamacpp", "superfluid-mlx", "llama-server", "mlx-lm-server", *extras]
    raise ValueError(f"unknown system {name!r}; known: {', '.join(known)}")


def attached_spec(name: str | None, port: int) -> SystemSpec:
    """A server someone else runs (``--url``): capabilities guessed from the name."""
    name = name or "external"
    if name.startswith("superfluid"):
        runtime = name.split("-", 1)[1] if "-" in name else "llamacpp"
        caps = Caps(family="superfluid", worker_pattern=f"superfluid-worker-{runtime}",
                    unload="openai-models-unload", qos_header=True, busy="metrics", resume=True)
    elif name == "llama-server":
        caps = Caps(family="llama-server", busy="slots")
    else:
        caps = Caps(family="other")
    return SystemSpec(name=name, argv=(), caps=caps, port=port)
