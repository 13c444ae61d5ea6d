"""The ``kvstore`` command: its parser, and each subcommand handed to its module (``serve``: the
daemon, ``stats``: read a running one, ``demo``: registered by the server package).

User errors end with one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvstore.cli.args import (
    EXIT_FAILURE,
    EXIT_USAGE,
    OneLineParser,
    add_version,
    expand_sources,
    subcommand,
)
from kvstore.cli.serve import (
    ENV_PREFIX,
    SERVE_SWITCH_INTERVAL_S,
    UsageError,
    add_serve_flags,
    serve_command,
)
from kvstore.cli.stats import add_stats_flags, stats_command


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstore`` parser: ``serve``, ``stats`` and ``demo`` (whose flags are its own)."""
    parser = OneLineParser(prog="kvstore", description="Tiered KV-cache block store daemon.")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    add_serve_flags(sub.add_parser("serve", help="run the daemon in the foreground"))
    add_stats_flags(sub.add_parser("stats", help="print a running daemon's stats"))
    sub.add_parser("demo", add_help=False,
                   help="daemon + engine + multi-turn chat, TTFT per tier (demo --help)")
    return parser


def _plugin_command(name: str) -> Any:
    """The ``main(argv) -> int`` that a package registers as ``kvstore NAME`` (entry point group
    ``kvstore.commands``), or None. The demo joins every part (daemon, engine, server); kvstore
    never imports the engine, so the server package registers it."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="kvstore.commands"):
        if entry.name == name:
            return entry.load()
    return None


def _demo(argv: list[str]) -> int:
    main_of_demo = _plugin_command("demo")
    if main_of_demo is None:
        print("kvstore demo: error: no package registers the demo (entry point group "
              "kvstore.commands); install the project with `pip install -e .`", file=sys.stderr)
        return EXIT_FAILURE
    return int(main_of_demo(argv) or 0)


def main(argv: list[str] | None = None,
         switch_interval_s: float = SERVE_SWITCH_INTERVAL_S) -> int:
    """Entry point of the ``kvstore`` console script. ``switch_interval_s``: the GIL switch
    interval ``serve`` runs under (benchmarks compare others)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # its flags belong to the demo program
        return _demo(argv[1:])
    parser = build_parser()
    if argv[:1] == ["serve"]:
        try:
            argv = ["serve", *expand_sources(subcommand(parser, "serve"), argv[1:], ENV_PREFIX)]
        except ValueError as exc:
            print(f"kvstore serve: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return serve_command(args, switch_interval_s)
        if args.command == "stats":
            return stats_command(args)
        return _demo([])
    except UsageError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvstore stats --json | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

