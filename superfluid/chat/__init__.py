"""Chat templates and text-side processing (stop strings)."""

from __future__ import annotations

from ._stops import TextStream as TextStream
from ._template import ChatTemplate as ChatTemplate
from ._template import TemplateRenderError as TemplateRenderError
from ._template import pick_template as pick_template
