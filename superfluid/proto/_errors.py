"""Protocol errors, named for the side at fault (after h11)."""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: the worker link or a record stream broke its rules."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids: a bug on our side."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids: restart the peer, never crash."""
