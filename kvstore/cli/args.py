"""The command-line vocabulary the `kvstore` and `kvengine` CLIs both import (neither imports
the other's CLI): argparse value types (SIZE, counts, ports, seconds, fractions), one-line errors
that name the right `--help`, help texts that show every option's default, the version."""

from __future__ import annotations

import argparse
import logging
import math
from typing import NoReturn

EXIT_USAGE = 2  # a user mistake, told in one line
EXIT_FAILURE = 1  # the command could not do its work
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
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):  # YAML's .inf: a timeout that never fires is no bound
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


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


# ------------------------------------------------------------------ config files and environment

CONFIG_HELP = ("YAML file of options: keys are the long flag names (ssd-dir or ssd_dir), values "
               "their values (a list for a flag that takes several; true for a switch). "
               "Precedence: command line, then ${prefix}NAME environment variables (NAME: the "
               "long flag name in capitals, - as _, e.g. ${prefix}{example}), then this file, "
               "then the defaults")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def add_config_option(parser: argparse.ArgumentParser, env_prefix: str, example: str) -> None:
    """``--config FILE`` (read by ``expand_sources`` before argparse sees the command line)."""
    text = CONFIG_HELP.replace("${prefix}", env_prefix).replace("{example}", example)
    parser.add_argument("--config", default=None, metavar="FILE.yaml", help=text)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every long option name of ``parser`` (``ssd-dir``), to its action; not help/version."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in ("help", "version", "config") or action.default == argparse.SUPPRESS:
            continue
        for flag in action.option_strings:
            if flag.startswith("--"):
                out[flag[2:]] = action
    return out


def _given(action: argparse.Action, argv: list[str]) -> bool:
    return any(token == flag or token.startswith(flag + "=")
               for token in argv for flag in action.option_strings)


def _as_tokens(flag: str, action: argparse.Action, value: object, source: str,
               negation: str | None = None) -> list[str]:
    """The command-line tokens that give ``value`` to ``flag``; ValueError naming ``source``.
    ``negation``: the switch's ``--no-`` twin, which false gives (else false leaves it out)."""
    if action.nargs == 0:
        text = str(value).strip().lower()
        if isinstance(value, bool) or text in _TRUE | _FALSE:
            if value is True or text in _TRUE:
                return [flag]
            return [negation] if negation else []
        raise ValueError(f"{source}: {flag} is a switch: give true or false, not {value!r}")
    if isinstance(value, dict):
        raise ValueError(f"{source}: {flag} takes a value, not a mapping")
    values = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    if isinstance(action, argparse._AppendAction):
        return [token for v in values for token in (flag, v)]
    if len(values) > 1 and action.nargs not in ("+", "*"):
        raise ValueError(f"{source}: {flag} takes one value, not {len(values)}")
    return [flag, *values]


def _yaml_loader():
    """PyYAML's safe loader with YAML 1.2's booleans: only true/false. YAML 1.1 also reads
    yes/no/on/off as booleans, so ``http: off`` reached ``--http`` as 'False'."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                 re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    return Loader


def _read_config(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loader = _yaml_loader()(f)  # a SafeLoader: plain data only
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    return data


def _config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


# Variables of the KVSTORE_ prefix that no command's option reads but the engine's kernels do
# (one environment often starts both programs): not named as unknown.
READ_ELSEWHERE = frozenset({
    "KVSTORE_ATTENTION",  # kernels/attention_backends.py: auto, cudnn or ours
    "KVSTORE_CUDNN_PLAN_CACHE",  # kernels/plan_cache.py: the built cuDNN graphs' folder, or off
    "KVSTORE_CUDNN_BUILDER",  # kernels/plan_builder.py: off builds graphs in line after ready
})


def expand_sources(parser: argparse.ArgumentParser, argv: list[str], env_prefix: str,
                   env: dict[str, str] | None = None) -> list[str]:
    """``argv`` with the options it does not give itself taken from ``{env_prefix}NAME``
    environment variables, else from ``--config FILE`` (both as command-line tokens in front,
    so argparse checks them as it checks typed ones). ValueError names the bad source."""
    import os

    env = dict(os.environ if env is None else env)
    options = _options(parser)
    path = _config_path(argv)
    from_file = {}
    for key, value in (_read_config(path) if path else {}).items():
        name = str(key).replace("_", "-")
        if name not in options:
            raise ValueError(f"--config {path}: {key!r} is not an option of {parser.prog}")
        from_file[name] = value
    for variable in sorted(env):
        if variable.startswith(env_prefix) and not variable.startswith(env_prefix + "DEBUG_") \
                and variable not in READ_ELSEWHERE \
                and variable[len(env_prefix):].lower().replace("_", "-") not in options:
            logging.getLogger("kvstore").warning(
                "$%s is not an option of %s: ignored", variable, parser.prog)
    front: list[str] = []
    seen: set[int] = set()
    for name, action in options.items():
        if id(action) in seen or _given(action, argv):
            continue
        twin = options.get("no-" + name)
        if twin is not None and _given(twin, argv):
            continue
        negation = "--no-" + name if twin is not None else None
        variable = env_prefix + name.upper().replace("-", "_")
        if variable in env:
            front += _as_tokens("--" + name, action, env[variable], f"${variable}", negation)
            seen.add(id(action))
        elif name in from_file:
            front += _as_tokens("--" + name, action, from_file[name], f"--config {path}",
                                negation)
            seen.add(id(action))
    return front + argv


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    """The parser of sub-command ``name`` of ``parser``, if it has one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None
