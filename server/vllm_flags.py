"""`vllm serve` flags that a moved command line carries and kvengine takes without their effect,
each for a stated reason: accepted as no-ops with one line at start that says why, or accepted
only with the value kvengine already behaves by (any other refused in one line).

Flags whose effect kvengine does not have and which would change answers or resources stay
unknown to the parser (argparse refuses them in one line).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from engine.sampling_params import MAX_LOGPROBS

# A switch vLLM has, and why it changes nothing here.
NO_OP_SWITCHES: dict[str, str] = {
    "--disable-log-requests": "kvengine logs no request unless --uvicorn-log-level is info",
    "--disable-log-stats": "kvengine logs no periodic stats (GET /metrics has them)",
    "--enable-chunked-prefill": "kvengine always splits long prefills into chunks",
}


def _only(flag: str, allowed: tuple[str, ...], why: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is not supported: {why}")
        return text

    check.__name__ = flag.lstrip("-").replace("-", "_")
    return check


def _max_logprobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value != MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"{value} is not supported: kvengine's limit is fixed "
                                         f"at {MAX_LOGPROBS} logprobs per token")
    return value


def _download_dir(text: str) -> str:
    raise argparse.ArgumentTypeError("kvengine downloads into the Hugging Face cache: set "
                                     "HF_HUB_CACHE to the folder instead")


# A flag with a value, the values kvengine behaves by, and what it does with any other.
VALUED: dict[str, tuple[Callable[[str], object], str]] = {
    "--load-format": (_only("--load-format", ("auto", "safetensors"),
                            "kvengine reads safetensors only"), "kvengine reads safetensors"),
    "--response-role": (_only("--response-role", ("assistant",),
                              "chat replies carry the role assistant"),
                         "chat replies carry the role assistant"),
    "--max-logprobs": (_max_logprobs, f"kvengine's limit is {MAX_LOGPROBS}"),
    "--download-dir": (_download_dir, ""),
}


def _dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The flags above, under ``vllm_*`` destinations (``notes`` reads them back), and vLLM's
    ``--root-path``, honoured (the prefix a proxy strips, for the app's URLs)."""
    parser.add_argument("--root-path", default="", metavar="PATH",
                        help="the path prefix a reverse proxy serves the API under, as vLLM's "
                        "and uvicorn's --root-path (default: none)")
    for flag, why in NO_OP_SWITCHES.items():
        parser.add_argument(flag, dest=_dest(flag), action="store_true",
                            help=f"accepted from vLLM command lines, no effect: {why}")
    for flag, (check, why) in VALUED.items():
        note = f"accepted only with that value ({why})" if why else "refused"
        parser.add_argument(flag, dest=_dest(flag), type=check, default=None,
                            help=f"vLLM's flag: {note} (default: not given)")


def notes(args: argparse.Namespace) -> list[str]:
    """One line per such flag given: that it changes nothing here, and why."""
    out = []
    for flag, why in NO_OP_SWITCHES.items():
        if getattr(args, _dest(flag), False):
            out.append(f"kvengine: {flag} has no effect here: {why}")
    for flag, (_, why) in VALUED.items():
        if getattr(args, _dest(flag), None) is not None:
            out.append(f"kvengine: {flag} {getattr(args, _dest(flag))} is what kvengine does "
                       f"anyway ({why})")
    return out
