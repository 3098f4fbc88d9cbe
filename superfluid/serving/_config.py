"""Daemon configuration: one frozen value, built by the CLI or by tests (read by ``api``, so it
sits below ``daemon``)."""

from __future__ import annotations

from pathlib import Path

import attrs

from .. import _defaults as D
from ..proto import SpecConfig
from ..runtime._home import home
from ..sched import PlannerConfig, QosClass

__all__ = ["ApiKey", "ModelSource", "ServeConfig", "default_sessions_dir", "secret_digest"]


@attrs.frozen(kw_only=True)
class ModelSource:
    spec: str        # a path, or a mock spec
    runtime: str
    name: str
    # the command that starts its worker (superfluid.runtime.worker_command); empty: this interpreter
    worker: tuple[str, ...] = ()


def secret_digest(secret: str) -> bytes:
    """SHA-256 of a key's secret: what is kept and compared, never the secret itself."""
    import hashlib

    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


@attrs.frozen(kw_only=True)
class ApiKey:
    """One client key: ``--api-key`` (named ``default``, admin) or an entry of ``--key-policy``."""

    name: str
    digest: bytes = attrs.field(repr=False)  # SHA-256 of the secret; the secret itself is not kept
    admin: bool = False
    klass: QosClass = QosClass.AGENT      # the QoS class of its requests that name none
    max_class: QosClass = attrs.field(default=attrs.Factory(lambda self: self.klass, takes_self=True))
    models: tuple[str, ...] | None = None  # the models it may use; None: any
    rate_limit_rpm: int = 0               # its own token bucket (requests a minute); 0: the per-peer one
    max_concurrent: int = 0               # generations at once, each until it ends; 0: no limit
    max_conversations: int = 0            # conversations its tenant keeps in the log; 0: no limit
    max_stored_bytes: int = 0             # bytes of its tenant's conversations in the log; 0: no limit

    @classmethod
    def from_secret(cls, name: str, secret: str, **kw: object) -> ApiKey:
        return cls(name=name, digest=secret_digest(secret), **kw)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class ServeConfig:
    models: tuple[ModelSource, ...]
    host: str = D.HOST
    port: int = D.PORT
    backlog: int = D.BACKLOG              # the listen backlog
    max_connections_per_client: int = D.MAX_CONNECTIONS_PER_CLIENT  # per client IP, loopback aside (0: no cap)
    header_timeout_s: float = D.HEADER_TIMEOUT_S  # until a complete request head (also the keep-alive idle time)
    sessions: Path | None = None          # None: ~/.superfluid/sessions
    socket: Path | None = None            # --socket: the unix socket speaking the WebSocket's ops (None: off)
    sessions_cache: bool = False          # start a fresh log, keeping the old one aside
    resume_ttl_s: float = D.RESUME_TTL_S  # a resumable generation nobody follows is cancelled after this
    max_batch: int = D.MAX_BATCH
    max_context: int = D.MAX_CONTEXT
    threads: int = D.THREADS
    host_cache_mb: int = D.HOST_CACHE_MB  # evicted prefixes kept in host memory, per model (0: off)
    park: bool = False                    # --park: a finished sequence's KV is kept in <sessions>/park
    park_budget_gb: float = D.PARK_BUDGET_GB  # --park-budget-gb: that directory's bytes, oldest evicted
    stream_interval_ms: int = D.STREAM_INTERVAL_MS  # tokens wait in the worker at most this long to share a chunk
    agent_stream_interval_ms: int = D.AGENT_STREAM_INTERVAL_MS  # the same for agent and background lanes
    cpu_yield: bool = True                # SCHED_BATCH while no request waits for a first token (_cpu.py)
    drain_timeout_s: float = D.DRAIN_TIMEOUT_S
    shutdown_grace_s: float = D.SHUTDOWN_GRACE_S  # SIGTERM/SIGINT: in-flight streams end typed within this
    default_qos: QosClass = QosClass.AGENT
    http_qos_header: bool = True
    planner: PlannerConfig = attrs.field(factory=PlannerConfig)
    hang_timeout_s: float = D.HANG_TIMEOUT_S
    worker_start_timeout_s: float = D.WORKER_START_TIMEOUT_S
    max_restarts: int = D.MAX_RESTARTS
    restart_window_s: float = D.RESTART_WINDOW_S
    api_keys: tuple[ApiKey, ...] = ()     # empty: no authentication (one anonymous tenant)
    allowed_hosts: tuple[str, ...] = ()   # Host names answered besides the built-in ones (reverse proxies)
    web_origins: tuple[str, ...] = ()     # browser origins allowed besides this machine's pages; "*": any
    rate_limit_rpm: int = 0               # requests a minute per TCP peer (0: no limit)
    insecure_no_auth: bool = False        # serve a non-loopback address with no key anyway
    ui: bool = True                       # the built-in page at /ui (api/_ui.py); --no-ui: 404
    max_conversation_bytes: int = D.MAX_CONVERSATION_BYTES  # a conversation's logged events, in bytes (413 beyond)
    max_message_bytes: int = D.MAX_MESSAGE_BYTES  # one message of a conversation, in bytes (413 beyond)
    max_conversation_events: int = D.MAX_CONVERSATION_EVENTS  # events in one conversation (413 beyond)
    files_quota_gb: float = D.FILES_QUOTA_GB  # GiB of files per tenant, uploads and batch outputs (0: no limit)
    files_max_bytes: int = D.FILES_MAX_BYTES  # one uploaded file (413 beyond)
    max_prompt_bytes: int = 0             # prompt bytes before tokenizing; 0: from the context (api/_lane.py)
    body_timeout_s: float = D.BODY_TIMEOUT_S  # a request body not complete within this is answered 408
    ws_idle_timeout_s: float = D.WS_IDLE_TIMEOUT_S  # an idle WebSocket (no message, nothing to follow) is closed
    max_queue: int = D.MAX_QUEUE  # queued jobs per QoS class per model; more is answered 429
    kv_bits: int = 16                     # --kv-bits: llama.cpp's K and V cache width (8: q8_0)
    deterministic: bool = False           # llama.cpp: batch-, chunk-, cache- and restart-invariant output (SPEC.md)
    model_dirs: tuple[Path, ...] = ()     # --model-dir: every *.gguf in them may be loaded over HTTP
    max_models: int = D.MAX_MODELS  # models (so worker processes) loaded at once
    idle_timeout_s: float = D.IDLE_TIMEOUT_S  # --idle-timeout: unload a model idle this long, never the default (0: never)
    aliases: tuple[tuple[str, str], ...] = ()  # --alias NAME=MODEL: another name a request may use for a model
    # --chat-template-file [MODEL=]PATH: (model name, or "" for every model, template source), read at startup
    chat_templates: tuple[tuple[str, str], ...] = ()
    pooling: str = ""                     # --pooling for embeddings: mean|cls|last ("": the GGUF's, else mean)
    check_memory: bool = True             # refuse a load whose weights + KV exceed available memory
    speculate: str = "off"                # --speculate off|auto|prompt-lookup, resolved per model by its worker
    spec_gates: SpecConfig = attrs.field(factory=SpecConfig)   # the --spec-* flags
    # the fleet (SPEC.md §14): nodes dial --fleet-listen, the head dials --fleet; the link is keyed by fleet_key
    fleet_listen: tuple[str, int] | None = None
    fleet_dial: tuple[tuple[str, int], ...] = ()
    fleet_key: bytes | None = attrs.field(default=None, repr=False)   # None: encrypted, not authenticated
    fleet_policy: str = "load-aware"      # load-aware | least-loaded | round-robin (serving/_placement.py)
    fleet_pool_high: float = 0.9          # load-aware skips a node whose KV pool is this full
    fleet_lease_s: float = 6.0            # a link with nothing received for this long is lost (both ends)
    fleet_mdns: bool = True               # advertise --fleet-listen as _superfluid-fleet._tcp
    fleet_wait_s: float = 15.0            # at start, how long the log's resumable sessions wait for their nodes

    @property
    def fleet(self) -> bool:
        return self.fleet_listen is not None or bool(self.fleet_dial)

    def chat_template_for(self, model: str) -> str:
        """The chat template given for ``model`` (its own entry, else the one for every model); "" for none."""
        given = dict(self.chat_templates)
        return given.get(model, given.get("", ""))


def default_sessions_dir() -> Path:
    """``$SUPERFLUID_HOME/sessions`` (``~/.superfluid/sessions``), beside the models, runtimes and logs."""
    return home() / "sessions"
