"""Command-line errors: one line on stderr and an exit code, never a traceback.

Exit codes: 1 a run-time failure (a port in use, a model that does not load,
a session not found), 2 a usage mistake (an unknown command or flag, a bad
value). Unknown commands and flags get a "did you mean" from :mod:`difflib`.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any, NoReturn

__all__ = ["RUNTIME", "USAGE", "CliError", "Parser", "HelpFormatter", "suggest"]

RUNTIME = 1
USAGE = 2


class CliError(Exception):
    """A failure to report as ``superfluid: <message>`` and exit ``code``."""

    def __init__(self, message: str, code: int = RUNTIME) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def suggest(word: str, candidates: list[str]) -> str:
    """`` (did you mean X?)`` for the closest candidate, or ``""``."""
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless its text already names one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action.default, (list, dict)) and not action.default:
            return text
        return super()._get_help_string(action)


class _Commands(argparse._SubParsersAction):
    """Subcommands that report their own unknown options: argparse hands a command's leftover
    words up to the top parser, whose error would name ``superfluid --help`` and suggest
    flags of other commands (``serve --park``: "did you mean --port?")."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        extras = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        command = self._name_parser_map.get(values[0])
        if extras and command is not None:  # the innermost command sees them first
            command.error(f"unrecognized arguments: {' '.join(extras)}")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line with a suggestion, exit 2. Abbreviations
    are off (``--max-batc 4`` is a mistake, not ``--max-batch``), in every subcommand too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)

    def error(self, message: str) -> NoReturn:
        message = self._with_suggestion(message)
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE)

    def _all_options(self) -> list[str]:
        """This command's own long options (a subcommand's are not offered here)."""
        return [o for action in self._actions for o in action.option_strings if o.startswith("--")]

    def _with_suggestion(self, message: str) -> str:
        choice = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice.group(3)) or [c.strip() for c in choice.group(3).split(",")]
            what = "command" if choice.group(1).lower() in ("command", "action") else f"value for {choice.group(1)}"
            return (f"unknown {what} {choice.group(2)!r}{suggest(choice.group(2), options)}; "
                    f"choose from {', '.join(options)}")
        unknown = re.match(r"unrecognized arguments: (.*)$", message)
        if unknown:
            words = unknown.group(1).split()
            flags = [w.split("=", 1)[0] for w in words if w.startswith("-")]
            if flags:
                return f"unknown option {flags[0]}{suggest(flags[0], self._all_options())}"
            return f"unexpected argument {words[0]!r}"
        required = re.match(r"the following arguments are required: (COMMAND|ACTION)", message)
        if required:
            return f"missing {required.group(1).lower()}"
        return message
