"""HTTP dialects over one ASGI app."""

from __future__ import annotations

from ._app import App as App
from ._http import ApiError as ApiError
from ._lane import MAX_PROMPT_BYTES as MAX_PROMPT_BYTES
from ._lane import PROMPT_BYTES_FLOOR as PROMPT_BYTES_FLOOR
from ._lane import PROMPT_BYTES_PER_TOKEN as PROMPT_BYTES_PER_TOKEN
