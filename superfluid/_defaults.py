"""The one place for the defaults of knobs that more than one layer declares.

The command line (``cli/_main.py``), the daemon's config (``serving/_config.py``),
the scheduler's config (``sched/``), the worker spec (``nursery/_worker.py``) and
the worker process's own arguments (``worker/_main.py``) all take their defaults
from here, so a default changes in one line and the help texts follow. Plain
constants, no imports: every layer (the worker process included) may import it.
"""

from __future__ import annotations

# --- where the daemon listens ---
HOST = "127.0.0.1"
PORT = 8453
BACKLOG = 4096                   # the listen backlog (the kernel caps it at net.core.somaxconn)
MAX_CONNECTIONS_PER_CLIENT = 256  # connections one client IP holds open at once (loopback not counted)
HEADER_TIMEOUT_S = 10.0          # a connection's request head must be complete this long after its accept

# --- one model's engine (daemon flags, WorkerSpec, the worker's argv) ---
MAX_BATCH = 8                    # lanes per model
MAX_CONTEXT = 4096               # tokens per lane
THREADS = 0                      # engine threads; 0: all cores
PARK_BUDGET_GB = 4.0             # --park: the park directory's budget (GiB, all models together)
HOST_CACHE_MB = 2048             # the daemon's default host cache per model (a bare worker's is 0: off)
STREAM_INTERVAL_MS = 40          # interactive/completion tokens wait at most this long to share a chunk
AGENT_STREAM_INTERVAL_MS = 100   # the same for agent and background lanes
WORKER_START_TIMEOUT_S = 300.0   # a worker's load and handshake

# --- the scheduler ---
STARVATION_TICKS = 8             # a queued job's class improves by one per this many ticks waited
PREFILL_BUDGET = 4096            # prompt tokens prefilled per tick
TICK_TARGET_MS = 250             # a busy tick's length
HANG_TIMEOUT_S = 60.0            # a tick or tokenize unanswered this long is a hung worker
MAX_QUEUE = 256                  # queued jobs per QoS class per model (429 beyond)

# --- supervision ---
MAX_RESTARTS = 3                 # worker restarts allowed within RESTART_WINDOW_S
RESTART_WINDOW_S = 60.0

# --- requests and sessions ---
RESUME_TTL_S = 300.0             # a resumable generation nobody follows runs on this long
DRAIN_TIMEOUT_S = 30.0           # SIGUSR1 waits this long for in-flight work
SHUTDOWN_GRACE_S = 5.0           # SIGTERM/SIGINT: in-flight streams end typed within this, then exit
WORKER_EXIT_GRACE_S = 30.0       # a worker whose link ended exits by then even if its engine is stuck in a call
BODY_TIMEOUT_S = 30.0            # a request body not complete within this is answered 408
WS_IDLE_TIMEOUT_S = 300.0        # an idle WebSocket is closed after this
MAX_MODELS = 4                   # models (worker processes) loaded at once
IDLE_TIMEOUT_S = 0.0             # --idle-timeout: unload a model idle this long, never the default (0: never)
MAX_CONVERSATION_BYTES = 16 << 20
MAX_MESSAGE_BYTES = 1 << 20
MAX_CONVERSATION_EVENTS = 10_000
FILES_QUOTA_GB = 10.0            # GiB of uploaded and batch output files per tenant (0: no limit)
FILES_MAX_BYTES = 200 << 20      # one uploaded file (413 beyond)
