"""What the daemon serves, as the HTTP handlers and the session store see it: the configuration,
a served model, the metrics, the model registry's interface and its load refusals, and the
keep-alive rules.

It sits below ``api`` and ``sessions`` and above ``nursery`` (the layers contract in
pyproject.toml): the daemon (``daemon/``) builds these and runs the registry; handlers and
sessions read them without importing the daemon, which imports them.
"""

from __future__ import annotations

from ._config import ApiKey as ApiKey
from ._config import ModelSource as ModelSource
from ._config import ServeConfig as ServeConfig
from ._config import default_sessions_dir as default_sessions_dir
from ._config import secret_digest as secret_digest
from ._keepalive import FOREVER as FOREVER
from ._keepalive import Expiring as Expiring
from ._keepalive import expires_at_wall as expires_at_wall
from ._keepalive import keep_alive_of as keep_alive_of
from ._keepalive import parse_keep_alive as parse_keep_alive
from ._metrics import Metrics as Metrics
from ._metrics import ModelMetrics as ModelMetrics
from ._model import ServedModel as ServedModel
from ._registry import InsufficientMemory as InsufficientMemory
from ._registry import Registry as Registry
from ._registry import TooManyModels as TooManyModels
