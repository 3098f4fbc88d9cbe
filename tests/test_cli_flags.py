"""No silent traps on the command line (#47): every numeric flag of every subcommand checks its
rule at parse time, abbreviations are mistakes, an unknown flag's hint comes from the command it
was given to, and a reader that goes away (``| head``) ends the command quietly."""

from __future__ import annotations

import argparse
import enum
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from superfluid.cli._main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _numeric(action: argparse.Action) -> bool:
    if action.type in (int, float):
        return True
    default = action.default
    return (isinstance(default, (int, float)) and not isinstance(default, (bool, enum.Enum))
            and action.nargs != 0)


def test_every_numeric_flag_of_every_command_checks_its_rule() -> None:
    """By construction: a numeric option's type carries a rule (superfluid/cli/_flags.py), so a
    new flag with a bare ``type=int`` fails here."""
    from superfluid.models.__main__ import build_parser as models_parser

    seen = 0
    for root in (build_parser(), models_parser()):
        for path, parser in _commands(root):
            assert parser.allow_abbrev is False, path
            for action in parser._actions:
                if not action.option_strings or not _numeric(action):
                    continue
                seen += 1
                assert getattr(action.type, "rule", None), f"{' '.join(path)} {action.option_strings[0]}: no rule"
    assert seen > 40  # the walk did reach serve's, node's, launch's, top's and batch's flags


@pytest.mark.parametrize("argv", [
    ["serve", "--prefill-budget", "0"], ["serve", "--max-batch", "0"], ["serve", "--max-context", "0"],
    ["serve", "--tick-target-ms", "0"], ["serve", "--starvation-ticks", "0"], ["serve", "--max-models", "0"],
    ["serve", "--hang-timeout", "0"], ["serve", "--threads", "-1"], ["serve", "--resume-ttl", "nan"],
    ["serve", "--port", "70000"], ["serve", "--rate-limit", "-5"], ["serve", "--fleet-pool-high", "1.5"],
    ["node", "join", "--max-batch", "0"], ["launch", "--wait", "0"], ["top", "--interval", "0"],
    ["batch", "list", "--limit", "0"], ["stop", "--timeout", "-1"],
])
def test_a_meaningless_number_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)  # parse only: an old, unchecked value would start a server
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.count("\n") == 1 and f"argument {argv[-2]}:" in err, err


@pytest.mark.parametrize("argv, word", [
    (["serve", "--max-batc", "4"], "--max-batc"), (["serve", "--host-cache", "1"], "--host-cache"),
    (["runtime", "install", "llamacpp", "--untest"], "--untest"),
])
def test_an_abbreviation_is_a_mistake(argv: list[str], word: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)  # parse only: an old, unchecked value would start a server
    assert exc.value.code == 2
    assert f"unknown option {word}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, hint, see", [
    # --from is `runtime install`'s, --max-batch serve's: each command offers only its own
    (["serve", "--frm", "x"], None, "superfluid serve --help"),
    (["serve", "--max-bach", "2"], "--max-batch", "superfluid serve --help"),
    (["runtime", "install", "llamacpp", "--frm", "x"], "--from", "superfluid runtime install --help"),
    (["runtime", "install", "llamacpp", "--max-bach", "2"], None, "superfluid runtime install --help"),
    (["session", "inspect", "s-1", "--sesions", "x"], "--sessions", "superfluid session inspect --help"),
])
def test_a_hint_comes_from_the_command_given_the_flag(argv: list[str], hint: str | None, see: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)  # parse only: an old, unchecked value would start a server
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert f"(see {see})" in err, err
    if hint is None:
        assert "did you mean" not in err, err
    else:
        assert f"did you mean {hint}?" in err, err


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "SUPERFLUID_HOME": str(home / ".superfluid"),
            "PYTHONPATH": str(ROOT)}


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``superfluid runtimes --json | head -1``: stdout's reader is gone before the write; the
    command exits 141 (as a shell reports SIGPIPE) with nothing on stderr."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE, whatever the timing
    try:
        done = subprocess.run([sys.executable, "-m", "superfluid", "runtimes", "--json"], stdout=write,
                              stderr=subprocess.PIPE, text=True, env=_env(tmp_path), timeout=60)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_models_module_help_fetches_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "superfluid.models", "--help"], capture_output=True, text=True,
                          env={**_env(tmp_path), "HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1"}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m superfluid.models") and "--mlx" in done.stdout
    assert not (tmp_path / ".superfluid").exists()  # nothing fetched, no cache made
