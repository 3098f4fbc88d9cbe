"""Chat templates and text-side processing: stop strings, reasoning channels, tool calls."""

from __future__ import annotations

from ._reasoning import ReasoningSplitter as ReasoningSplitter
from ._reasoning import reasoning_tags as reasoning_tags
from ._jsonclose import document_schema as document_schema
from ._stops import StopScan as StopScan
from ._stops import TextStream as TextStream
from ._template import TEMPLATE_NAMES as TEMPLATE_NAMES
from ._template import ChatTemplate as ChatTemplate
from ._template import TemplateRenderError as TemplateRenderError
from ._template import pick_template as pick_template
from ._template import read_template_file as read_template_file
from ._tools import Delta as Delta
from ._tools import ForcedCallParser as ForcedCallParser
from ._tools import ReplyParser as ReplyParser
from ._tools import Tool as Tool
from ._tools import ToolCall as ToolCall
from ._tools import ToolCallParser as ToolCallParser
from ._tools import ToolChoice as ToolChoice
from ._tools import ToolWire as ToolWire
from ._tools import call_markers as call_markers
from ._tools import call_schema as call_schema
from ._tools import close_json as close_json
from ._tools import detect_wire as detect_wire
from ._tools import flatten_tool_messages as flatten_tool_messages
from ._tools import forced_prefill as forced_prefill
from ._tools import new_call_id as new_call_id
from ._tools import parse_call_body as parse_call_body
from ._tools import render_chatml as render_chatml
from ._tools import repair_json as repair_json
from ._tools import template_knows_tools as template_knows_tools
