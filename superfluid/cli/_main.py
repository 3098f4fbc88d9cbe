"""``superfluid`` command line."""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import trio

from .. import _defaults as D
from .._errors import first_leaf, leaves
from ..serving import InsufficientMemory, ModelSource, ServeConfig
from ..api import MAX_PROMPT_BYTES, PROMPT_BYTES_FLOOR, PROMPT_BYTES_PER_TOKEN
from ..models._files import default_model_path, model_name
from .. import __version__
from ..journal import JournalLocked, WalCorrupt
from ..nursery import WorkerDied, WorkerLoadFailed
from ._errors import USAGE, CliError, HelpFormatter, Parser
from ._flags import in_range, kv_bits, nonneg_float, nonneg_int, port, positive_float, positive_int
from ..sched import PlannerConfig, QosClass, parse_qos
from ..proto import MAX_DRAFT_DEPTH, SPEC_DIRECTIVES, SpecConfig
from ..models._hub import PullError
from ._models import COMMANDS as MODEL_COMMANDS, PullInterrupted, add_commands as add_model_commands, hub_model
from ._launch import add_launch_parsers, split_agent_args
from ._top import add_top_parser

__all__ = ["main"]


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (a port 0 to 65535), got {value!r}")
    return host.strip("[]"), int(port)


def _qos(value: str) -> QosClass:
    try:
        return parse_qos(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _class_lanes(value: str) -> dict[QosClass, int]:
    out = {}
    for item in filter(None, value.split(",")):
        name, _, n = item.partition("=")
        try:
            out[parse_qos(name)] = int(n)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="superfluid", description="A local LLM serving daemon on trio.",
                    formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"superfluid {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="serve models over HTTP (OpenAI, Anthropic and Ollama APIs on one port)",
                       description="Serve models over HTTP: OpenAI, Anthropic and Ollama APIs on one port.",
                       formatter_class=HelpFormatter)
    s.add_argument("model", nargs="?",
                   help="a GGUF file, or 'mock' (default: the embedded SmolLM2-135M-Instruct, fetched once)")
    s.add_argument("--model", dest="models", action="append", default=[], metavar="MODEL",
                   help="another model to serve beside the first (repeatable; default: none)")
    s.add_argument("--offline", action="store_true",
                   help="fetch nothing: a Hugging Face id (org/repo[:QUANT]) is looked for only in the cache, "
                        "never pulled, and a runtime that is not installed is refused (default: installed on "
                        "first use)")
    s.add_argument("--runtime", action="append", default=[],
                   help="ID[@INSTALL], or MODEL=ID[@INSTALL] (llamacpp, mlx, basert, mock; auto: by the model's "
                        "format, the default); `superfluid runtimes` lists them")
    s.add_argument("--http", type=_hostport, metavar="HOST:PORT",
                   help=f"address to listen on; overrides --host and --port (default {D.HOST}:{D.PORT})")
    s.add_argument("--host", default=D.HOST, help="address to listen on")
    s.add_argument("--port", type=port, default=D.PORT, help="TCP port to listen on (0: any free port)")
    s.add_argument("--backlog", type=positive_int, default=D.BACKLOG,
                   help="connections the kernel queues for accept; a burst beyond it is dropped or reset "
                        f"(default {D.BACKLOG}; Linux caps it at net.core.somaxconn)")
    s.add_argument("--max-connections-per-client", type=nonneg_int, default=D.MAX_CONNECTIONS_PER_CLIENT, metavar="N",
                   help="connections one client IP may hold open at once; one more is answered 429 "
                        "too_many_connections and closed; loopback clients are not counted "
                        f"(default {D.MAX_CONNECTIONS_PER_CLIENT}; 0: no cap)")
    s.add_argument("--header-timeout", type=positive_float, default=D.HEADER_TIMEOUT_S, metavar="SEC",
                   help="seconds a connection has to send a complete request head, from its accept or from "
                        "the end of its previous response (so also how long an idle keep-alive connection "
                        f"stays); then it is closed (default {D.HEADER_TIMEOUT_S:g})")
    s.add_argument("--sessions", type=Path, help="sessions directory (default $SUPERFLUID_HOME/sessions, ~/.superfluid/sessions)")
    s.add_argument("--sessions-cache", action="store_true",
                   help="treat the session log as a cache: keep the old one aside and start fresh")
    s.add_argument("--resume-ttl", type=nonneg_float, default=D.RESUME_TTL_S,
                   help="seconds a resumable generation runs on with no client following it")
    s.add_argument("--max-batch", type=positive_int, default=D.MAX_BATCH, help=f"lanes per model (default {D.MAX_BATCH})")
    s.add_argument("--max-context", type=positive_int, default=D.MAX_CONTEXT,
                   help=f"tokens per lane (default {D.MAX_CONTEXT})")
    s.add_argument("--threads", type=nonneg_int, default=D.THREADS, help="engine threads (default: all cores)")
    s.add_argument("--host-cache-mb", type=nonneg_int, default=D.HOST_CACHE_MB,
                   help="MiB of host memory per model for prefixes evicted from the KV pool (0: off)")
    s.add_argument("--park", action=argparse.BooleanOptionalAction, default=False,
                   help="keep a finished generation's KV (256+ tokens) on disk in <sessions>/park; a later prompt "
                        "that extends it (same tenant and cache_salt) restores it instead of prefilling, also "
                        "after a restart (default off)")
    s.add_argument("--park-budget-gb", type=positive_float, default=D.PARK_BUDGET_GB,
                   help=f"GiB the park directory may hold, least recently used evicted first "
                        f"(default {D.PARK_BUDGET_GB:g})")
    s.add_argument("--kv-bits", type=kv_bits, default=16,
                   help="llama.cpp: bits per K and V cache value, 16 (f16) or 8 (q8_0: half the KV memory, with "
                        "flash attention; a parked state restores only into the width it was saved with; not "
                        "with --deterministic; default 16)")
    s.add_argument("--stream-interval-ms", type=nonneg_int, default=D.STREAM_INTERVAL_MS,
                   help="generated tokens of interactive and completion requests wait in the worker at most "
                        "this long to share one chunk; a first token and a last one never wait "
                        f"(default {D.STREAM_INTERVAL_MS}; 0: every engine round)")
    s.add_argument("--agent-stream-interval-ms", type=nonneg_int, default=D.AGENT_STREAM_INTERVAL_MS,
                   help="the same for requests of the agent and background classes, which programs read "
                        f"(default {D.AGENT_STREAM_INTERVAL_MS}; 1 ms more per open agent lane, up to 1 s): "
                        "fewer chunks leave more CPU to the engine")
    s.add_argument("--no-cpu-yield", action="store_true",
                   help="do not run the daemon SCHED_BATCH while it only relays tokens (Linux; see SPEC.md)")
    s.add_argument("--drain-timeout", type=nonneg_float, default=D.DRAIN_TIMEOUT_S,
                   help="seconds SIGUSR1 (drain) waits for in-flight requests before exiting")
    s.add_argument("--shutdown-grace", type=positive_float, default=D.SHUTDOWN_GRACE_S,
                   help="seconds SIGTERM/Ctrl-C gives in-flight streams to end with a server_shutting_down "
                        "error and [DONE] before the daemon exits (a second signal exits at once)")
    s.add_argument("--http-default-qos", type=_qos, default=QosClass.AGENT, metavar="CLASS",
                   help="QoS class of requests with no x-superfluid-qos header "
                        "(interactive, completion, agent, background; default agent)")
    s.add_argument("--no-http-qos-header", action="store_true",
                   help="ignore the x-superfluid-qos request header (every request gets --http-default-qos)")
    s.add_argument("--class-lanes", type=_class_lanes, default={}, metavar="CLASS=N,...",
                   help="at most N lanes for a QoS class, e.g. background=2,agent=6 (default: no caps)")
    s.add_argument("--starvation-ticks", type=positive_int, default=D.STARVATION_TICKS,
                   help="a waiting job's class rises one step every this many scheduler ticks")
    s.add_argument("--prefill-budget", type=positive_int, default=D.PREFILL_BUDGET,
                   help="prompt tokens prefilled per scheduler tick at most")
    s.add_argument("--tick-target-ms", type=positive_int, default=D.TICK_TARGET_MS,
                   help="length of a scheduler tick while nothing waits (50 ms while a job is queued)")
    s.add_argument("--hang-timeout", type=positive_float, default=D.HANG_TIMEOUT_S,
                   help="seconds a worker may leave a tick, a send or a tokenize unanswered before it is replaced")
    s.add_argument("--no-tui", action="store_true",
                   help="no live monitor: log lines on stderr instead (default: the monitor when stdout is a "
                        "terminal; q in it drains and quits)")
    s.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], metavar="LEVEL",
                   help="least severe log records written (DEBUG, INFO, WARNING, ERROR, CRITICAL; "
                        "DEBUG also logs every non-generating request)")
    s.add_argument("--log-dir", type=Path, metavar="DIR",
                   help="also write the log as JSON lines to DIR/superfluid.jsonl (rotated at 16 MiB, 4 kept; "
                        "files 0600 in a 0700 directory; default: stderr only)")
    s.add_argument("--api-key", metavar="KEY",
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on every route but "
                        "GET /health; an admin key named 'default' (default: $SUPERFLUID_API_KEY, else none)")
    s.add_argument("--key-policy", type=Path, metavar="FILE",
                   help="JSON file of keys with their QoS class, models, rate and concurrency limits, admin flag "
                        "(see README 'Security'; default: none)")
    s.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host is NAME, e.g. behind a reverse proxy (repeatable; "
                        "default: loopback names only, or with a non-loopback bind its IPs and this machine's name)")
    s.add_argument("--web-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of ORIGIN (http(s)://HOST[:PORT], or *) call the API (repeatable; "
                        "also $SUPERFLUID_ORIGINS, comma-separated; default: pages on this machine only)")
    s.add_argument("--rate-limit", type=nonneg_int, default=0, metavar="RPM",
                   help="requests a minute per client IP, keys with their own rate_limit_rpm aside; "
                        "/health and /metrics exempt (default 0: no limit)")
    s.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-loopback address with no API key (refused by default)")
    s.add_argument("--no-ui", action="store_true",
                   help="do not serve the built-in web page (GET /ui; a browser's GET / goes there; default: served)")
    s.add_argument("--max-conversation-bytes", type=positive_int, default=D.MAX_CONVERSATION_BYTES,
                   help=f"bytes a conversation's events may hold; more is refused with 413 "
                        f"(default {D.MAX_CONVERSATION_BYTES})")
    s.add_argument("--max-message-bytes", type=positive_int, default=D.MAX_MESSAGE_BYTES,
                   help=f"bytes one conversation message may hold; more is refused with 413 "
                        f"(default {D.MAX_MESSAGE_BYTES})")
    s.add_argument("--max-conversation-events", type=positive_int, default=D.MAX_CONVERSATION_EVENTS,
                   help=f"events one conversation may hold; more is refused with 413 "
                        f"(default {D.MAX_CONVERSATION_EVENTS})")
    s.add_argument("--files-quota-gb", type=nonneg_float, default=D.FILES_QUOTA_GB, metavar="GIB",
                   help="GiB of files (uploads to /v1/files and batch outputs) each key's tenant may keep; an upload "
                        f"past it is refused with 413 files_quota_exceeded (default {D.FILES_QUOTA_GB:g}; 0: no limit)")
    s.add_argument("--files-max-bytes", type=positive_int, default=D.FILES_MAX_BYTES, metavar="BYTES",
                   help="bytes one uploaded file may hold; more is refused with 413 payload_too_large "
                        f"(default {D.FILES_MAX_BYTES})")
    s.add_argument("--max-prompt-bytes", type=_prompt_bytes, default=0,
                   help="bytes of rendered prompt a request may send to the tokenizer; more is answered 413 "
                        f"(default 0: {PROMPT_BYTES_PER_TOKEN} per token of the model's context, at least "
                        f"{PROMPT_BYTES_FLOOR >> 20} MiB; at most {MAX_PROMPT_BYTES >> 20} MiB)")
    s.add_argument("--body-timeout", type=positive_float, default=D.BODY_TIMEOUT_S,
                   help="seconds a request body may take to arrive; then 408 and the connection closes "
                        f"(default {D.BODY_TIMEOUT_S:g})")
    s.add_argument("--socket", type=Path, default=None, metavar="PATH",
                   help="also serve the WebSocket's ops (/v1/ws) as newline-delimited JSON on a unix socket at PATH, "
                        "made 0600: whoever may open it acts as the admin (default: off)")
    s.add_argument("--ws-idle-timeout", type=positive_float, default=D.WS_IDLE_TIMEOUT_S,
                   help="seconds a WebSocket may stay with no message from the client and no session to follow; "
                        f"then it is closed with 1001 (default {D.WS_IDLE_TIMEOUT_S:g})")
    s.add_argument("--max-queue", type=positive_int, default=D.MAX_QUEUE,
                   help="requests waiting for a lane per QoS class per model; more are answered 429 queue_full "
                        f"(default {D.MAX_QUEUE})")
    s.add_argument("--model-dir", dest="model_dirs", action="append", type=Path, default=[], metavar="DIR",
                   help="a directory whose *.gguf files clients may load over HTTP, by name or path (repeatable; "
                        "default: only the models cache directory and the models given here)")
    s.add_argument("--max-models", type=positive_int, default=D.MAX_MODELS, metavar="N",
                   help="models (and so worker processes) loaded at once; a load beyond it is refused "
                        f"with 429 too_many_models (default {D.MAX_MODELS})")
    s.add_argument("--idle-timeout", type=nonneg_float, default=D.IDLE_TIMEOUT_S, metavar="SEC",
                   help="unload a model no request has used for SEC seconds; never the default model (the first); "
                        f"it loads again on the next request naming it (default {D.IDLE_TIMEOUT_S:g}: never)")
    s.add_argument("--alias", dest="aliases", action="append", type=_alias, default=[], metavar="NAME=MODEL",
                   help="let requests name MODEL (a model given here or in a --model-dir) as NAME too, e.g. "
                        "gpt-4o-mini=SmolLM2-135M-Instruct.Q4_1 (repeatable; default: none)")
    s.add_argument("--chat-template-file", dest="chat_template_files", action="append", type=_template_file,
                   default=[], metavar="[MODEL=]PATH",
                   help="render chats with the Jinja chat template in PATH instead of the model's own: for MODEL "
                        "only, or without MODEL= for every model without one of its own here (repeatable; "
                        "checked at startup; default: each model's own)")
    s.add_argument("--pooling", choices=("mean", "cls", "last"), default=None,
                   help="how embeddings pool a text's token vectors (default: the model's own, else mean)")
    s.add_argument("--no-memory-check", action="store_true",
                   help="load a model even when its weights and KV cache exceed available memory "
                        "($SUPERFLUID_MEMORY_AVAILABLE pretends an amount, for tests)")
    _add_speculation(s)
    from ._fleet import add_fleet_parsers, add_head_flags

    add_head_flags(s, _hostport)
    s.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="llama.cpp: a request's output does not depend on what else runs beside it, on load, "
                        "on the prefix cache or on a worker restart (see SPEC.md 'Determinism'; costs "
                        "throughput and prefix reuse; default off)")
    from ._session import add_session_parser

    add_session_parser(sub)
    add_model_commands(sub, _hostport)  # pull, models, rm (cli/_models.py)
    add_top_parser(sub)
    add_launch_parsers(sub)
    from ._runtimes import add_parsers as add_runtime_parsers

    add_runtime_parsers(sub)
    add_fleet_parsers(sub, _hostport)
    from ._batch import add_batch_parser

    add_batch_parser(sub)
    return parser


def _security(args: argparse.Namespace) -> dict[str, Any]:
    """The ServeConfig fields of the security flags. Raises ValueError (one line)."""
    from ..daemon._keypolicy import load_keys
    from ..api._guard import parse_allowed_host, parse_web_origin

    if args.rate_limit < 0:
        raise ValueError("--rate-limit must be >= 0")
    api_key = args.api_key if args.api_key is not None else os.environ.get("SUPERFLUID_API_KEY") or None
    env_origins = os.environ.get("SUPERFLUID_ORIGINS", "").split(",")
    origins = [*args.web_origin, *filter(None, (o.strip() for o in env_origins))]
    return {"api_keys": load_keys(api_key, args.key_policy, os.environ),
            "web_origins": tuple(parse_web_origin(o) for o in origins),
            "allowed_hosts": tuple(parse_allowed_host(h) for h in args.allowed_host),
            "rate_limit_rpm": args.rate_limit, "insecure_no_auth": args.insecure_no_auth,
            "ui": not args.no_ui}



def _add_speculation(s: argparse.ArgumentParser) -> None:
    d = SpecConfig()
    s.add_argument("--speculate", choices=SPEC_DIRECTIVES, default="off",
                   help="prompt-lookup drafts the tokens that followed the last earlier occurrence of a lane's last "
                        "three (else two) tokens and verifies them in one pass (exact: greedy output is unchanged); "
                        "auto = prompt-lookup where the model's KV can drop a rejected draft, else plain; with "
                        "several models each resolves on its own (default off)")
    s.add_argument("--spec-draft-tokens", type=in_range(int, 1, MAX_DRAFT_DEPTH), default=d.depth, metavar="N",
                   help=f"the deepest draft (1-{MAX_DRAFT_DEPTH}; default {d.depth})")
    s.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=d.adaptive,
                   help="pick the draft depth with the most measured tokens/s per lane count (default on)")
    s.add_argument("--spec-min-yield", type=in_range(float, 0, MAX_DRAFT_DEPTH), default=d.min_yield,
                   help=f"a request averaging fewer accepted draft tokens a round stops drafting; two such and none "
                        f"passing abandon speculation (default {d.min_yield})")
    s.add_argument("--spec-yield-rounds", type=in_range(int, 1, 1 << 20), default=d.yield_rounds, metavar="N",
                   help=f"drafting rounds before the yield floor judges a request (default {d.yield_rounds})")
    s.add_argument("--spec-throughput-gate", action=argparse.BooleanOptionalAction, default=d.throughput_gate,
                   help="measure drafting against plain decoding per lane count; decode plainly where it is not "
                        "--spec-min-speedup faster (default on)")
    s.add_argument("--spec-gate-probe-tokens", type=in_range(int, 1, 4096), default=d.probe_rounds, metavar="N",
                   help=f"rounds of each side a throughput probe measures (default {d.probe_rounds})")
    s.add_argument("--spec-min-speedup", type=in_range(float, 0.01, 100), default=d.min_speedup,
                   help=f"the speedup a lane count must measure to keep drafting (default {d.min_speedup})")
    s.add_argument("--spec-gate-reprobe", type=in_range(int, 1, 1 << 20), default=d.reprobe, metavar="N",
                   help=f"requests before a lane count that failed the gate is measured again, doubling each time "
                        f"(default {d.reprobe})")
    s.add_argument("--spec-gate-reprobe-max", type=in_range(int, 1, 1 << 20), default=d.reprobe_max, metavar="N",
                   help=f"the longest re-probe interval (default {d.reprobe_max})")
    s.add_argument("--spec-max-temperature", type=in_range(float, 0, 100), default=None, metavar="T",
                   help="requests sampling hotter than T never draft (default: no cap)")


def _speculation(args: argparse.Namespace) -> SpecConfig:
    if args.spec_gate_reprobe_max < args.spec_gate_reprobe:
        raise CliError("--spec-gate-reprobe-max must be at least --spec-gate-reprobe", USAGE)
    return SpecConfig(depth=args.spec_draft_tokens, adaptive=args.spec_adaptive, min_yield=args.spec_min_yield,
                      yield_rounds=args.spec_yield_rounds, throughput_gate=args.spec_throughput_gate,
                      probe_rounds=args.spec_gate_probe_tokens, min_speedup=args.spec_min_speedup,
                      reprobe=args.spec_gate_reprobe, reprobe_max=args.spec_gate_reprobe_max,
                      max_temperature=-1.0 if args.spec_max_temperature is None else args.spec_max_temperature)


def _alias(value: str) -> tuple[str, str]:
    name, sep, model = value.partition("=")
    if not sep or not name.strip() or not model.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL, got {value!r}")
    return name.strip(), model.strip()


def _template_file(value: str) -> tuple[str, Path]:
    """``[MODEL=]PATH`` (a path that exists is a path, even with ``=`` in it)."""
    model, sep, path = value.partition("=")
    if not sep or Path(value).exists():
        return "", Path(value)
    if not model.strip() or not path:
        raise argparse.ArgumentTypeError(f"expected PATH or MODEL=PATH, got {value!r}")
    return model.strip(), Path(path)


def _chat_templates(args: argparse.Namespace, sources: tuple[ModelSource, ...]) -> tuple[tuple[str, str], ...]:
    """The ``--chat-template-file`` templates, read and compiled now: a mistake is one line at startup.

    Raises:
        CliError: a file missing, unreadable or not a template; a MODEL not served; a model given twice.
    """
    from ..chat import read_template_file
    from ..daemon._registry import model_dir_names

    served = {s.name for s in sources} | set(model_dir_names(tuple(args.model_dirs)))
    aliases = dict(args.aliases)
    out: dict[str, str] = {}
    for model, path in args.chat_template_files:
        flag = f"--chat-template-file {model + '=' if model else ''}{path}"
        model = aliases.get(model, model)
        if model and model not in served:
            raise CliError(f"{flag}: no model {model!r} is served (models: {', '.join(sorted(served))})", USAGE)
        if model in out:
            raise CliError(f"{flag}: {'model ' + repr(model) if model else 'every model'} already has a template "
                           "file", USAGE)
        try:
            out[model] = read_template_file(path)
        except ValueError as exc:
            raise CliError(f"--chat-template-file {exc}", USAGE) from None
    return tuple(out.items())


def _prompt_bytes(value: str) -> int:
    if not value.isdigit() or int(value) > MAX_PROMPT_BYTES:
        raise argparse.ArgumentTypeError(f"expected 0 (from the context) to {MAX_PROMPT_BYTES}, got {value!r}")
    return int(value)


_prompt_bytes.rule = f"0 (from the context) to {MAX_PROMPT_BYTES}"  # type: ignore[attr-defined]


def _sources(args: argparse.Namespace) -> list[ModelSource]:
    """The models to serve, each with its runtime and worker, chosen and checked before
    anything loads. Raises CliError (a missing or unreadable file, 1) or SystemExit (a runtime
    refused, 2), in one line."""
    from ..runtime._choose import split_selector

    specs = ([args.model] if args.model else []) + list(args.models)
    default_runtime = None
    per_model: dict[str, str] = {}
    for r in args.runtime:
        if "=" in r:
            m, _, rid = r.rpartition("=")
            per_model[m] = rid
        else:
            default_runtime = r
    if not specs:
        if split_selector(default_runtime)[0] == "mock":
            specs = ["mock"]
        else:
            try:
                specs = [str(default_model_path())]
            except FileNotFoundError as exc:
                raise CliError(f"no model given and the default one is not available: {exc}") from None
    out = []
    for spec in specs:
        selector = per_model.get(spec, default_runtime)
        if split_selector(selector)[0] == "mock" and not spec.startswith("mock"):
            spec = "mock"
        is_mock = spec == "mock" or spec.startswith("mock?")
        pulled = hub_model(spec, offline=args.offline) if not is_mock else None  # org/repo[:QUANT]
        if pulled is not None:
            choice = _choose(str(pulled.path), selector, args)
            out.append(ModelSource(spec=str(pulled.path), runtime=choice.info.id, name=pulled.name,
                                   worker=choice.worker))
            continue
        if not is_mock:
            _check_model_file(Path(spec))
            _check_model_format(spec)  # before a runtime is chosen, installed or advised
        choice = _choose(spec, selector, args)
        runtime = choice.info.id
        if runtime == "llamacpp" and not Path(spec).is_file():
            raise CliError(f"model {spec} is not a file (llama.cpp loads a GGUF file)")
        out.append(ModelSource(spec=spec, runtime=runtime, name=model_name(spec, runtime), worker=choice.worker))
    return out


def _choose(spec: str, selector: str | None, args: argparse.Namespace) -> Any:
    """The runtime Choice for one model; a runtime with no install is installed here unless
    --offline. Raises SystemExit: refused (2) or the install failed (1), in one line."""
    from ..runtime._choose import RuntimeRefused, choose

    try:
        return choose(spec, selector)
    except RuntimeRefused as exc:
        if exc.install is None or args.offline:
            print(f"superfluid: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        rid = exc.install
    from ._runtimes import install_on_first_use

    install_on_first_use(rid)
    try:
        return choose(spec, selector)
    except RuntimeRefused as exc:
        print(f"superfluid: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _check_model_file(path: Path) -> None:
    if not path.exists():
        raise CliError(f"model file not found: {path}")
    if not os.access(path, os.R_OK):
        raise CliError(f"model {path} is not readable (permission denied)")


def _check_model_format(spec: str) -> None:
    """Raises CliError if no runtime reads ``spec`` (by its magic, or a directory's files): saying
    so beats advice to install llama.cpp, or a worker started to fail on it."""
    from ..runtime._registry import detect_format

    if detect_format(spec) is not None:
        return
    if Path(spec).is_dir():
        raise CliError(f"{spec} is not a model: a model directory is an MLX model (config.json and *.safetensors) "
                       "or a .base bundle, and llama.cpp loads a GGUF file")
    raise CliError(f"{spec} is not a model: not a GGUF file (it does not begin with GGUF's magic) nor a .base "
                   "bundle; `superfluid runtimes MODEL` says which runtime reads a file")


def _check_limits(args: argparse.Namespace, sources: tuple[ModelSource, ...]) -> str | None:
    """A mistake in --model-dir, --max-models or --kv-bits, in one line; None if there is none."""
    for directory in args.model_dirs:
        if not directory.is_dir():
            return f"--model-dir {directory}: not a directory"
    bits = getattr(args, "kv_bits", 16)
    if bits != 16:
        if getattr(args, "deterministic", False):
            return f"--kv-bits {bits}: a quantised KV needs flash attention, which --deterministic turns off"
        for s in sources:
            if s.runtime != "llamacpp":
                return f"--kv-bits {bits}: model {s.name!r} runs on {s.runtime}, whose KV cache is 16-bit only"
    if args.max_models < max(1, len(sources)):
        return f"--max-models {args.max_models}: must be at least 1 and the {len(sources)} models given at startup"
    from ..daemon._registry import model_dir_names

    from ..models._hub import hub_name_in
    from ..models._library import entries

    names = {s.name for s in sources} | set(model_dir_names(tuple(args.model_dirs)))
    names |= {e.name for e in entries() if e.kind in ("pull", "copy")} if args.aliases else set()
    for alias, target in args.aliases:
        if target not in names and hub_name_in(target, names) is None:  # (org/repo, hf.co/...: as requests)
            return (f"--alias {alias}={target}: no model {target!r} is served (models: "
                    f"{', '.join(sorted(names))})")
        if alias in names:
            return f"--alias {alias}={target}: {alias!r} is already a model's name"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, 1 run-time failure, 2 usage; 141 when
    stdout's reader went away, as ``superfluid runtimes --json | head -1`` does)."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe fails here, where it is caught, not at interpreter exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE  # what a shell reports for a program SIGPIPE ended (Python docs)


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of what the pipe refused is quiet."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # a replaced stdout (tests): nothing flushes at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _run(argv: list[str] | None) -> int:
    argv, agent_args = split_agent_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if args.command in ("runtimes", "runtime"):
        from ._runtimes import run as run_runtime_command

        return run_runtime_command(args)
    if args.command in MODEL_COMMANDS:
        return MODEL_COMMANDS[args.command](args)
    if getattr(args, "run", None) is not None:  # top, launch, stop (cli/_top.py, cli/_launch.py)
        if agent_args:
            args.agent_args = agent_args
        return int(args.run(args))
    try:
        if args.command == "session":
            from ._session import run_session

            return run_session(args)
        return _serve(args)
    except CliError as exc:
        print(f"superfluid: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 0


def _serve(args: argparse.Namespace) -> int:
    from ..daemon._logs import configure_logging
    from ..daemon._server import serve
    from ..api._guard import exposure_refusal, is_loopback_listener

    try:
        configure_logging(args.log_level, args.log_dir)
    except OSError as exc:
        raise CliError(f"--log-dir {args.log_dir}: {exc.strerror or exc}") from None
    host, port = args.http if args.http else (args.host, args.port)
    try:
        security = _security(args)
    except ValueError as exc:
        raise CliError(str(exc), USAGE) from None
    _check_port(host, port)  # before a model loads: a port in use fails at once
    from ..runtime._home import cleanup_all

    cleanup_all()  # what an install killed midway left (staging directories), before choosing installs
    from ._fleet import head_config

    fleet = head_config(args, _hostport)
    try:
        # a fleet head given no model serves its nodes' models only
        sources = tuple(_sources(args)) if (args.model or args.models or not fleet) else ()
    except PullInterrupted as exc:
        raise CliError(str(exc), 130) from None
    except PullError as exc:
        raise CliError(str(exc)) from None
    mistake = _check_limits(args, sources)
    if mistake is not None:
        raise CliError(mistake, USAGE)
    chat_templates = _chat_templates(args, sources)
    config = ServeConfig(
        models=sources, host=host, port=port, sessions=args.sessions, backlog=args.backlog,
        max_connections_per_client=args.max_connections_per_client, header_timeout_s=args.header_timeout,
        sessions_cache=args.sessions_cache, resume_ttl_s=args.resume_ttl, max_batch=args.max_batch,
        max_context=args.max_context, threads=args.threads, host_cache_mb=args.host_cache_mb,
        park=args.park, park_budget_gb=args.park_budget_gb, stream_interval_ms=args.stream_interval_ms, agent_stream_interval_ms=args.agent_stream_interval_ms,
        cpu_yield=not args.no_cpu_yield, drain_timeout_s=args.drain_timeout, shutdown_grace_s=args.shutdown_grace,
        default_qos=args.http_default_qos, http_qos_header=not args.no_http_qos_header,
        planner=PlannerConfig(max_batch=args.max_batch, class_lanes=args.class_lanes,
                              starvation_ticks=args.starvation_ticks, prefill_budget=args.prefill_budget,
                              tick_busy_ms=args.tick_target_ms),
        hang_timeout_s=args.hang_timeout, **security,
        max_conversation_bytes=args.max_conversation_bytes, max_message_bytes=args.max_message_bytes,
        max_conversation_events=args.max_conversation_events, files_quota_gb=args.files_quota_gb,
        files_max_bytes=args.files_max_bytes,
        max_prompt_bytes=args.max_prompt_bytes, body_timeout_s=args.body_timeout,
        ws_idle_timeout_s=args.ws_idle_timeout, socket=args.socket, max_queue=args.max_queue, deterministic=args.deterministic, kv_bits=args.kv_bits,
        model_dirs=tuple(args.model_dirs), max_models=args.max_models, idle_timeout_s=args.idle_timeout,
        aliases=tuple(args.aliases), pooling=args.pooling or "", check_memory=not args.no_memory_check,
        speculate=args.speculate, spec_gates=_speculation(args), chat_templates=chat_templates, **fleet,
    )
    refusal = exposure_refusal(config)
    if refusal is not None:
        raise CliError(refusal, USAGE)
    if not config.api_keys and not is_loopback_listener(host):
        print(f"superfluid: warning: serving {host} with no API key (--insecure-no-auth)", file=sys.stderr)
    try:
        monitor = not args.no_tui and sys.stdout.isatty()
        trio.run(functools.partial(serve, config, monitor=monitor))
    except Exception as exc:  # noqa: BLE001 - the process boundary: one line, never a traceback
        raise _startup_error(exc, host, port) from None
    except BaseExceptionGroup as group:
        if group.subgroup((KeyboardInterrupt, SystemExit)) is not None:
            raise
        raise _startup_error(group, host, port) from None
    return 0


def _check_port(host: str, port: int) -> None:
    """Raises CliError if ``host:port`` cannot be bound now (hypercorn binds it once the models loaded)."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}", USAGE) from None
    family, kind, proto, _name, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn binds
        try:
            probe.bind(addr)
        except OSError as exc:
            raise _startup_error(exc, host, port) from None


def _startup_error(exc: BaseException, host: str, port: int) -> CliError:
    """What went wrong, as one line: the first failure of ``exc`` (a group's leaves) that we know."""
    for leaf in leaves(exc):
        if isinstance(leaf, (JournalLocked, WalCorrupt)):
            return CliError(str(leaf), USAGE)
        if isinstance(leaf, InsufficientMemory):
            return CliError(f"model did not load: {leaf}", 3)  # (SPEC §8 "The memory check")
        if isinstance(leaf, WorkerLoadFailed):
            return CliError(f"model did not load: {leaf}")
        if isinstance(leaf, WorkerDied):
            return CliError(f"worker did not start: {leaf}")
        if isinstance(leaf, OSError) and leaf.errno == errno.EADDRINUSE:
            return CliError(f"cannot listen on {host}:{port}: the address is already in use "
                            "(another server runs there; pick one with --port)")
        if isinstance(leaf, OSError) and leaf.errno in (errno.EACCES, errno.EADDRNOTAVAIL):
            return CliError(f"cannot listen on {host}:{port}: {leaf.strerror}")
    logging.getLogger("superfluid").debug("startup failed", exc_info=exc)
    first = first_leaf(exc)
    return CliError(f"{type(first).__name__}: {first} (--log-level DEBUG shows the traceback)")
