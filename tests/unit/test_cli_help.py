"""Every command, flag and argument of the CLI says what it is in ``--help``, and ``--version``
names the installed version.

The argparse tree is walked from ``build_parser()``, so a flag added without ``help=`` anywhere,
in any subcommand's module, fails here by its path (``compactd recompact --rate``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Iterator

import pytest

from compactd.scheduler.cli import build_parser, main


def walk(parser: argparse.ArgumentParser, path: str
         ) -> Iterator[tuple[str, argparse.Action | None, str | None]]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", None, helps.get(name)
                yield from walk(sub, f"{path} {name}")
            continue
        names = "/".join(action.option_strings) or action.dest
        yield f"{path} {names}", action, action.help


def test_every_command_flag_and_argument_has_help() -> None:
    entries = list(walk(build_parser(), "compactd"))
    assert len(entries) > 60  # the walk reaches the subcommands' own flags
    missing = [path for path, _, text in entries
               if not text or text == argparse.SUPPRESS or not text.strip()]
    assert missing == [], "no help= for: " + ", ".join(missing)


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"compactd {importlib.metadata.version('compactd')}\n"
