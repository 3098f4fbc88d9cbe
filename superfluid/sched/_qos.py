"""QoS classes: names, aliases, numeric priority (0 is most urgent)."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["QosClass", "parse_qos"]


class QosClass(IntEnum):
    INTERACTIVE = 0
    COMPLETION = 1
    AGENT = 2
    BACKGROUND = 3

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def preempts(self) -> bool:
        return self <= QosClass.COMPLETION


_LABELS = {
    QosClass.INTERACTIVE: "interactive_chat",
    QosClass.COMPLETION: "inline_completion",
    QosClass.AGENT: "foreground_agent",
    QosClass.BACKGROUND: "background_agent",
}
_ALIASES = {
    "interactive": QosClass.INTERACTIVE, "interactive-chat": QosClass.INTERACTIVE,
    "completion": QosClass.COMPLETION, "inline-completion": QosClass.COMPLETION,
    "agent": QosClass.AGENT, "foreground": QosClass.AGENT, "foreground-agent": QosClass.AGENT,
    "background": QosClass.BACKGROUND, "background-agent": QosClass.BACKGROUND,
}


def parse_qos(value: str) -> QosClass:
    """Raises ValueError for an unknown class name."""
    try:
        return _ALIASES[value.strip().lower()]
    except KeyError:
        raise ValueError(
            f"invalid x-superfluid-qos header {value!r}: expected one of interactive, completion, agent, background"
        ) from None
