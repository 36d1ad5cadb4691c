"""Issue 26 item 5: every flag of every `kvserve` subcommand has help text, and its help shows the default
(cli/main.py HelpFormatter appends it unless the text already states one, or there is none to show)."""

from __future__ import annotations

import argparse

import pytest

from kvserve.cli.main import HelpFormatter, build_parser, main


def _subcommands(parser: argparse.ArgumentParser, name: str = "kvserve"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _subcommands(sub, f"{name} {sub_name}")


def _flags(parser: argparse.ArgumentParser):
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return [a for a in parser._actions if not isinstance(a, skip)]


COMMANDS = list(_subcommands(build_parser()))


def test_every_subcommand_is_walked():
    names = {name for name, _ in COMMANDS}
    assert {"kvserve serve", "kvserve plan", "kvserve render", "kvserve router", "kvserve bench spec"} <= names


@pytest.mark.parametrize("name, parser", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_flag_has_help_that_shows_its_default(name, parser):
    assert parser.formatter_class is HelpFormatter, name
    formatter = parser._get_formatter()
    for action in _flags(parser):
        label = f"{name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help.strip(), f"{label} has no help"
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        if action.default not in (None, False):
            text = formatter._expand_help(action)
            assert "default" in text.lower(), f"{label}: its help does not show the default {action.default!r}"


def test_help_renders_for_every_subcommand(capsys):
    for name, _ in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([*name.split()[1:], "--help"])
        assert exit_info.value.code == 0, name
    assert "port to listen on (default: 8000)" in capsys.readouterr().out
