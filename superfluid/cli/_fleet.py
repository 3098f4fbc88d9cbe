"""``superfluid fleet token``, ``superfluid node join|serve`` and the head's fleet flags (SPEC.md §14)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import trio

from .. import _defaults as D
from ._errors import USAGE, CliError, HelpFormatter
from ._flags import fraction, nonneg_float, nonneg_int, positive_int

__all__ = ["add_fleet_parsers", "add_head_flags", "head_config"]

POLICIES = ("load-aware", "least-loaded", "round-robin")


def superfluid_home() -> Path:
    home = os.environ.get("SUPERFLUID_HOME")
    return Path(home) if home else Path.home() / ".superfluid"


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        import ipaddress

        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _token_help(side: str) -> str:
    return (f"the fleet token (64 hex characters, or @FILE) that keys the {side}'s encrypted link; default: "
            "$SUPERFLUID_FLEET_TOKEN, else the file `superfluid fleet token` writes "
            "($SUPERFLUID_HOME/fleet/token), if there is one")


def _key(args: argparse.Namespace, host: str, what: str) -> bytes | None:
    """The link's key, or None (encrypted, unauthenticated): allowed on loopback, or with
    --insecure-no-auth. Raises CliError (2) in one line."""
    from ..fleet._channel import load_token

    value = args.token or os.environ.get("SUPERFLUID_FLEET_TOKEN")
    try:
        key = load_token(value, superfluid_home())
    except (ValueError, OSError) as exc:
        raise CliError(f"--token: {exc}", USAGE) from None
    if key is None and not _is_loopback(host) and not args.insecure_no_auth:
        raise CliError(f"{what} {host} is not loopback and there is no fleet token: run `superfluid fleet token` "
                       "and pass --token on both sides (or --insecure-no-auth: encrypted, anyone may join)", USAGE)
    return key


def add_head_flags(s: argparse.ArgumentParser, hostport: Any) -> None:
    """The fleet flags of ``serve`` (the head)."""
    s.add_argument("--fleet-listen", type=hostport, metavar="HOST:PORT",
                   help="be a fleet head: nodes (`superfluid node join`) dial this address; advertised by mDNS "
                        "as _superfluid-fleet._tcp (default: off)")
    s.add_argument("--fleet", dest="fleet_dial", default="", metavar="HOST:PORT,...",
                   help="be a fleet head: dial these nodes (`superfluid node serve --listen`), again every 10 s "
                        "while one is unreachable (default: none)")
    s.add_argument("--fleet-token", dest="token", metavar="TOKEN", help=_token_help("head"))
    s.add_argument("--fleet-policy", choices=POLICIES, default="load-aware",
                   help="where a request runs among the nodes of its model")
    s.add_argument("--fleet-pool-high", type=fraction, default=0.9, metavar="FRACTION",
                   help="load-aware placement skips a node whose KV pool is this full")
    s.add_argument("--no-fleet-mdns", action="store_true", help="do not advertise --fleet-listen by mDNS")
    s.add_argument("--fleet-wait", type=nonneg_float, default=15.0, metavar="SEC",
                   help="at start, how long resumable sessions in the log wait for their models' nodes to join "
                        "before they are resumed (those whose model has no node then stay in the log)")


def head_config(args: argparse.Namespace, hostport: Any) -> dict[str, Any]:
    """ServeConfig's fleet fields from ``serve``'s flags. Raises CliError in one line."""
    dial = []
    for item in filter(None, (x.strip() for x in args.fleet_dial.split(","))):
        try:
            dial.append(hostport(item))
        except argparse.ArgumentTypeError as exc:
            raise CliError(f"--fleet {item}: {exc}", USAGE) from None
    if args.fleet_listen is None and not dial:
        return {}
    if not 0 < args.fleet_pool_high <= 1:
        raise CliError("--fleet-pool-high: a fraction in (0, 1]", USAGE)
    hosts = [h for h, _ in dial] + ([args.fleet_listen[0]] if args.fleet_listen else [])
    key = None
    for host in hosts:
        key = _key(args, host, "--fleet-listen" if args.fleet_listen and host == args.fleet_listen[0] else "--fleet")
    return {"fleet_listen": args.fleet_listen, "fleet_dial": tuple(dial), "fleet_key": key,
            "fleet_policy": args.fleet_policy, "fleet_pool_high": args.fleet_pool_high,
            "fleet_mdns": not args.no_fleet_mdns, "fleet_wait_s": max(0.0, args.fleet_wait)}


def add_fleet_parsers(sub: Any, hostport: Any) -> None:
    f = sub.add_parser("fleet", help="the fleet's token", formatter_class=HelpFormatter,
                       description="The fleet: a head (`serve --fleet-listen`) and nodes (`node join`).")
    fsub = f.add_subparsers(dest="fleet_command", required=True, metavar="COMMAND")
    t = fsub.add_parser("token", help="print the fleet token (made the first time: 32 random bytes, hex, 0600)",
                        formatter_class=HelpFormatter,
                        description="Print the fleet token, making it the first time ($SUPERFLUID_HOME/fleet/token, "
                                    "mode 0600). Give it to nodes with --token.")
    t.set_defaults(run=_token_main)
    n = sub.add_parser("node", help="serve a model to a fleet head", formatter_class=HelpFormatter,
                       description="A fleet node: one model's worker, reached by a head over an encrypted link.")
    nsub = n.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
    j = nsub.add_parser("join", help="dial a head (found by mDNS when HEAD is omitted) and serve it",
                        formatter_class=HelpFormatter,
                        description="Dial the head and serve it a model; dial again whenever the link drops.")
    j.add_argument("head", nargs="?", metavar="HEAD",
                   help="the head's --fleet-listen address, HOST:PORT (default: found by mDNS)")
    ns = nsub.add_parser("serve", help="wait for a head to dial this node (`serve --fleet HOST:PORT`)",
                         formatter_class=HelpFormatter,
                         description="Listen for a head's link and serve it a model (the head dials).")
    ns.add_argument("--listen", type=hostport, required=True, metavar="HOST:PORT",
                    help="address the head dials")
    for p in (j, ns):
        p.add_argument("model", nargs="?", help="a GGUF file, an org/repo[:QUANT] id, or 'mock' "
                                               "(default: the embedded SmolLM2-135M-Instruct)")
        p.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as MODEL")
        p.add_argument("--model-name", help="the name the head serves it under (default: the model's own)")
        p.add_argument("--runtime", action="append", default=[], help="ID[@INSTALL] (default: by the format)")
        p.add_argument("--offline", action="store_true", help="fetch nothing")
        p.add_argument("--token", metavar="TOKEN", help=_token_help("node"))
        p.add_argument("--insecure-no-auth", action="store_true",
                       help="take part without a token off loopback (still encrypted; anyone may connect)")
        p.add_argument("--identity", help="the node's name at the head (default: host name and a random suffix)")
        p.add_argument("--max-batch", type=positive_int, default=D.MAX_BATCH, help="lanes")
        p.add_argument("--max-context", type=positive_int, default=D.MAX_CONTEXT, help="tokens per lane")
        p.add_argument("--threads", type=nonneg_int, default=D.THREADS, help="engine threads (default: all cores)")
        p.add_argument("--deterministic", action="store_true", help="as serve --deterministic")
        p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
        p.set_defaults(run=_node_main, models=[], fleet_role=p is j)


def _token_main(args: argparse.Namespace) -> int:
    from ..fleet._channel import ensure_token

    try:
        print(ensure_token(superfluid_home()))
    except (OSError, ValueError) as exc:
        print(f"superfluid: fleet token: {exc}", file=sys.stderr)
        return 1
    return 0


def _node_main(args: argparse.Namespace) -> int:
    try:
        return _node(args)
    except CliError as exc:
        print(f"superfluid: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 0


def _looks_like_address(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit())


def _node(args: argparse.Namespace) -> int:
    from ..fleet._node import NodeConfig, join, serve_node
    from ..fleet._remote import NodeHello
    from ..nursery import WorkerSpec
    from ._main import _hostport as hostport
    from ._main import _sources

    for flag, value in (("--max-batch", args.max_batch), ("--max-context", args.max_context)):
        if value < 1:
            raise CliError(f"{flag} {value}: must be at least 1", USAGE)
    if args.fleet_role and args.head is not None:
        if args.model is None and not _looks_like_address(args.head):
            args.head, args.model = None, args.head    # `node join MODEL`: the head is found by mDNS
        else:
            try:
                args.head = hostport(args.head)
            except argparse.ArgumentTypeError as exc:
                raise CliError(f"HEAD {args.head}: {exc}", USAGE) from None
    if args.model and args.model_flag:
        raise CliError("give the model once (MODEL or --model)", USAGE)
    args.model = args.model or args.model_flag
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the token and the address are checked, and a listener bound, before anything is downloaded
    joining = args.fleet_role
    host = args.head[0] if joining and args.head else ("" if joining else args.listen[0])
    key = _key(args, host or "0.0.0.0", "the head" if joining else "--listen")
    listener = None
    if not joining:
        listener = socket.socket(socket.AF_INET6 if ":" in args.listen[0] else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(args.listen)
        except OSError as exc:
            raise CliError(f"--listen {args.listen[0]}:{args.listen[1]}: {exc.strerror or exc}") from None
        finally:
            listener.close()
    source = _sources(args)[0]
    name = args.model_name or source.name
    identity = args.identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    spec = WorkerSpec(runtime=source.runtime, model=source.spec, max_batch=args.max_batch,
                      max_context=args.max_context, threads=args.threads, deterministic=args.deterministic,
                      command=source.worker)
    hello = NodeHello(identity=identity, model=name, runtime=source.runtime, lanes=args.max_batch,
                      n_ctx=args.max_context)
    config = NodeConfig(spec=spec, hello=hello, key=key)
    if joining:
        trio.run(functools.partial(join, config, args.head))
    else:
        trio.run(functools.partial(serve_node, config, args.listen[0], args.listen[1]))
    return 0
