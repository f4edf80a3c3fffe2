"""`--help` says every flag's meaning and default, and the flag tables of docs/cli.md agree
with the parsers: a flag added, removed or given a new default fails here until the
reference says so too; the README names only flags that exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pagedinfer.service.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README, FLAG_DOC = ROOT / "README.md", ROOT / "docs" / "cli.md"
TABLES = ("| engine flag | default | what |", "| `serve` flag | default | what |")


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser(name)
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        action.option_strings[-1]: action
        for action in parser._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    }


def readme_rows() -> dict[str, str]:
    """Each flag of the two flag tables of docs/cli.md -> its default cell."""
    text = FLAG_DOC.read_text()
    rows: dict[str, str] = {}
    for header in TABLES:
        assert header in text, f"docs/cli.md lost its table {header!r}"
        for line in text[text.index(header) :].splitlines()[2:]:
            if not line.startswith("|"):
                break
            flags, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
            defaults = [d.strip() for d in default.split(",")]
            names = re.findall(r"`(--[a-z0-9-]+)`", flags)
            assert names, f"a docs/cli.md row names no flag: {line}"
            for i, name in enumerate(names):
                rows[name] = defaults[i] if len(defaults) == len(names) else default
    return rows


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_a_meaning_and_its_default_in_help(command: str) -> None:
    parser = subcommand(command)
    text = parser.format_help()
    for flag, action in options(parser).items():
        assert action.help, f"{command} {flag} has no help text"
        valued = action.nargs != 0 and action.default is not None and action.default != []
        if valued:
            rendered = parser._get_formatter()._expand_help(action)
            assert "default" in rendered, f"{command} --help does not say {flag}'s default"
    if command == "serve":
        assert "HTTP" in parser.description and "gRPC" in parser.description
        assert parser.description in text


def test_the_readme_tables_list_every_engine_and_server_flag_with_its_default() -> None:
    serve = options(subcommand("serve"))
    rows = readme_rows()
    assert set(rows) == set(serve), (
        f"the flag tables of docs/cli.md and `serve --help` differ: only in docs/cli.md "
        f"{sorted(set(rows) - set(serve))}, only in --help {sorted(set(serve) - set(rows))}"
    )
    for flag, cell in rows.items():
        action = serve[flag]
        shown = re.fullmatch(r"`([^`]+)`", cell)
        if shown is None:  # words: a computed default, a switch, or none at all
            assert action.default is None or action.nargs == 0, (
                f"docs/cli.md gives {flag} no value, but its default is {action.default!r}"
            )
            continue
        value = shown.group(1)
        if isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
            assert float(value) == float(action.default), f"docs/cli.md: {flag} {value}"
        else:
            assert value == str(action.default), f"docs/cli.md: {flag} {value} != {action.default}"


def test_the_readme_names_only_flags_that_exist() -> None:
    known = set(options(subcommand("serve"))) | set(options(subcommand("generate")))
    known |= {"-n"}
    section = README.read_text().split("### Command line", 1)[1].split("### Python", 1)[0]
    named = set(re.findall(r"`(--[a-z0-9-]+)", section + FLAG_DOC.read_text()))
    assert named <= known, f"the docs name flags no command has: {sorted(named - known)}"
