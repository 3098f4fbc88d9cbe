"""The startup summary: what an operator needs to know once the daemon listens.

:func:`summary_lines` returns the block as lines (no printing): ``serve`` logs
it once on the ``superfluid.summary`` logger; a terminal monitor may show the
same lines in its own frame instead (``serve(..., announce=...)``). The block
holds the only "Running on" line of a start.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__

if TYPE_CHECKING:
    from ..serving import ServedModel, ServeConfig

__all__ = ["DIALECTS", "model_facts", "summary_lines"]

# What one port serves, by dialect (SPEC.md §8).
DIALECTS = (
    ("OpenAI", "/v1/chat/completions /v1/completions /v1/responses /v1/models"),
    ("Anthropic", "/v1/messages"),
    ("Ollama", "/api/chat /api/generate /api/tags"),
    ("sessions", "/v1/sessions /v1/ws"),
)


def model_facts(model: ServedModel, config: ServeConfig) -> dict[str, Any]:
    """One loaded model as the summary (and a monitor) describes it."""
    info = model.info
    lanes = int((model.actor.ack.limits if model.actor.ack else {}).get("max_lanes", config.max_batch))
    n_seq = int(info.get("n_seq", 0))
    n_ctx_seq = int(info.get("n_ctx_seq", 0))
    cells = int((info.get("extra") or {}).get("n_ctx", 0)) or n_seq * n_ctx_seq
    return {"name": model.name, "runtime": model.runtime, "source": model.path, "context": n_ctx_seq,
            "lanes": lanes, "kv_cells": cells, "host_cache_mb": config.host_cache_mb if model.runtime != "mock" else 0}


def _auth(config: ServeConfig) -> str:
    keys = config.api_keys
    if not keys:
        return "off (no key: loopback clients only)" if not config.insecure_no_auth else "off (--insecure-no-auth)"
    names = ", ".join(k.name for k in keys[:4]) + (", …" if len(keys) > 4 else "")
    return f"on ({len(keys)} key{'s' if len(keys) != 1 else ''}: {names})"


def summary_lines(config: ServeConfig, models: Iterable[ServedModel], binds: list[str], *,
                  sessions_dir: Path, default: str | None = None) -> list[str]:
    """The startup block, one string a line (no trailing newlines)."""
    lines = [f"superfluid {__version__}"]
    for bind in binds:
        lines.append(f"  Running on {bind} (Ctrl-C stops; in-flight streams end typed)")
    for model in models:
        f = model_facts(model, config)
        mark = " (default)" if model.name == default else ""
        host = f"host cache {f['host_cache_mb']} MiB" if f["host_cache_mb"] else "host cache off"
        lines.append(f"  model {f['name']}{mark}: runtime {f['runtime']}, from {f['source']}")
        lines.append(f"    context {f['context']} tokens per lane, {f['lanes']} lanes, "
                     f"{f['kv_cells']} KV cells, {host}")
        if config.speculate != "off":
            caps = model.actor.ack.capabilities if model.actor.ack else {}
            said = str(caps.get("speculation", "off"))
            lines.append(f"    speculation: {said if said == 'prompt-lookup' else f'off ({config.speculate}: {said})'}")
    if config.fleet:
        lines += _fleet_lines(config, models)
    lines.append("  dialects: " + "; ".join(f"{name} {routes}" for name, routes in DIALECTS))
    if config.ui and binds:
        lines.append(f"  page: {binds[0].rstrip('/')}/ui/ (a browser's / goes there; --no-ui turns it off)")
    lines.append(f"  sessions: {sessions_dir}")
    if config.park:
        lines.append(f"  park: {sessions_dir / 'park'} (up to {config.park_budget_gb:g} GiB, least recently used evicted)")
    lines.append(f"  auth: {_auth(config)}")
    return lines


def _fleet_lines(config: ServeConfig, models: Iterable[ServedModel]) -> list[str]:
    """A head's fleet: where nodes join, how the link is keyed, the nodes there already."""
    link = "encrypted, fleet token required" if config.fleet_key else "encrypted, no token (loopback only)"
    out = []
    if config.fleet_listen is not None:
        host, port = config.fleet_listen
        mdns = ", advertised by mDNS" if config.fleet_mdns else ""
        out.append(f"  fleet: nodes join at {host}:{port} ({link}{mdns}); placement {config.fleet_policy}")
    if config.fleet_dial:
        out.append("  fleet: dialling nodes " + ", ".join(f"{h}:{p}" for h, p in config.fleet_dial) + f" ({link})")
    for model in models:
        for node in (model.group.describe() if model.group is not None else []):
            out.append(f"    node {node['node']} ({model.name}): context window {node['n_ctx']} tokens, "
                       f"{node['lanes']} lanes")
    return out
