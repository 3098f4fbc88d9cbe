"""HTTP dialects over one ASGI app."""

from __future__ import annotations

from ._app import App as App
from ._http import ApiError as ApiError
