"""The `pagedinfer` command: dispatches to the module that owns each subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`, and keeps
heavy imports (torch, grpc, kopf) inside `run`, so that `pagedinfer --help` stays fast and
one subcommand never pays for another's dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pagedinfer.service.openmp import spin_env

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "pagedinfer.service.server",
        "serve a model: the OpenAI-compatible HTTP API, gRPC and Prometheus metrics",
    ),
    "generate": (
        "pagedinfer.service.generate",
        "generate text with a local engine, or from a running server with --server",
    ),
    "simulate": (
        "pagedinfer.service.simulate",
        "replay a request trace through the scheduler and block manager (no model)",
    ),
    "operator": ("pagedinfer.operator.main", "run the Kubernetes operator"),
}
# The subcommands that run an engine in this process, and so want its OpenMP settings.
ENGINE_COMMANDS = ("serve", "generate")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every flag's default said, unless its text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        # A switch (nargs 0: store_true and the like) has no value to show.
        shown = action.nargs != 0 and default is not None and default is not argparse.SUPPRESS
        if shown and default != [] and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedinfer", description="Kubernetes-native LLM inference on PagedAttention."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == command:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    if command in ENGINE_COMMANDS:  # before torch loads, or libgomp never reads it
        os.environ.update(spin_env())
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:
        print(f"pagedinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv: its first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def entry() -> None:
    """The `pagedinfer` command: `main`, then, after `generate`, an exit that skips
    interpreter shutdown (over a second of tearing down torch and numba once the answer
    is out; nothing of the command's is left to close)."""
    code = main()
    if _command(sys.argv[1:]) == "generate":
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
