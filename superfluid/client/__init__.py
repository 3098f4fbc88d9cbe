"""A small client for superfluid's resumable streams (trio and blocking).

Both flavours speak HTTP/1.1 + SSE through h11 (a dependency already):
``open_chat_stream`` over trio sockets, ``stream_chat`` over blocking
sockets, one sans-IO core for both. A dropped connection or a daemon restart
is resumed from the last SSE id: the deltas go on with nothing repeated.
"""

from __future__ import annotations

from ._core import ChatStreamError as ChatStreamError
from ._core import ResumePolicy as ResumePolicy
from ._core import StreamLost as StreamLost
from ._sse import aiter_sse as aiter_sse
from ._sync import SyncChatStream as SyncChatStream
from ._sync import stream_chat as stream_chat
from ._trio import ChatStream as ChatStream
from ._trio import open_chat_stream as open_chat_stream
