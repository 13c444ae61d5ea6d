"""The command-line vocabulary the `kvstore` and `kvengine` CLIs both import (neither imports
the other's CLI): argparse value types (SIZE, counts, ports, seconds, fractions), one-line errors
that name the right `--help`, help texts that show every option's default, the version."""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_USAGE = 2
DISTRIBUTION = "kvstore-tiered"  # "kvstore" on PyPI is an unrelated project


def size_arg(text: str) -> int:
    """argparse type: a SIZE (``512MiB``, ``16Gi``, ``1.5GB``, ``16G`` or bytes)."""
    from kvstore.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float_arg(text: str) -> float:
    """argparse type: a number > 0 (seconds, mostly)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def positive_int_arg(text: str) -> int:
    """argparse type: a whole number >= 1."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def non_negative_int_arg(text: str) -> int:
    """argparse type: a whole number >= 0."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return value


def port_arg(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    value = non_negative_int_arg(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {text!r}")
    return value


def fraction_arg(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _number(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def package_version() -> str:
    """The installed distribution's version, or ``unknown`` when run from a bare checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the text already names its default;
    flags show ``(default: off)`` or ``(default: on)``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "default" in text):
            return text
        if action.nargs == 0 and isinstance(action.const, bool):  # store_true / store_false
            shown = "off" if action.const else "on"
        elif action.default is None:
            return text  # the option's own text must say what happens without it
        else:
            shown = str(action.default).replace("%", "%%")
        return f"{text} (default: {shown})".strip()


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error that points to the `--help` of the command that failed.

    argparse reports unrecognized arguments from the top-level parser, so ``kvstore serve
    --drm 1GiB`` would point to ``kvstore --help``; ``parse_args`` hands them to the chosen
    sub-command's parser instead.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._owner_of(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _owner_of(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest:
                chosen = getattr(parsed, action.dest, None)
                if chosen in action.choices:
                    return action.choices[chosen]
        return self


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: print the program name and the installed version, then exit."""
    parser.add_argument("--version", action="version",
                        version=f"{parser.prog} {package_version()}")
