"""`vllm serve` flags that a moved command line carries and kvengine takes without their effect,
each for a stated reason: accepted as no-ops with one line at start that says why, or accepted
only with the value kvengine already behaves by (any other refused in one line).

Flags whose effect kvengine does not have and which would change answers or resources stay
unknown to the parser (argparse refuses them in one line).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping

from engine.sampling_params import MAX_LOGPROBS

# A switch vLLM has, and why it changes nothing here.
NO_OP_SWITCHES: dict[str, str] = {
    "--disable-log-requests": "kvengine logs no request unless --uvicorn-log-level is info",
    "--disable-log-stats": "kvengine logs no periodic stats (GET /metrics has them)",
    "--enable-chunked-prefill": "kvengine always splits long prefills into chunks",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details (cached "
                                      "tokens, and by tier)",
    "--disable-uvicorn-access-log": "kvengine's access log is off unless --uvicorn-log-level "
                                    "is info",
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


def _any(text: str) -> str:
    return text


def _log_requests(text: str) -> str:
    raise argparse.ArgumentTypeError("kvengine does not log requests' prompts or parameters "
                                     "(its access log, --uvicorn-log-level info, names the "
                                     "requests); drop the flag")


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
    "--pipeline-parallel-size": (_only("--pipeline-parallel-size", ("1",),
                                       "kvengine runs a model on one device"),
                                 "kvengine runs a model on one device"),
    "--kv-cache-dtype": (_only("--kv-cache-dtype", ("auto",),
                               "the KV cache keeps the model's dtype (bf16 on a GPU)"),
                         "the KV cache keeps the model's dtype"),
    "--distributed-executor-backend": (_only("--distributed-executor-backend", ("mp", "uni"),
                                             "kvengine runs in one process, without Ray"),
                                       "kvengine runs in one process"),
    "--structured-outputs-config.backend": (
        _only("--structured-outputs-config.backend", ("auto", "guidance"),
              "kvengine's grammars are llguidance (vLLM's `guidance`), with xgrammar's "
              "defaults where they differ (a schema without additionalProperties is closed)"),
        "kvengine's grammars are llguidance"),
    "--swap-space": (_any, "kvengine never swaps a preempted request's KV to host memory: it "
                           "recomputes it, or with --kv-offload restores it from the store"),
    "--max-log-len": (_any, "kvengine logs no prompts"),
}
# Short spellings vLLM has for the flags above.
ALIASES = {"--pipeline-parallel-size": ("-pp",)}
# A flag whose effect kvengine lacks and that a moved command line may carry: refused with why.
REFUSED = {"--enable-log-requests": _log_requests}


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
        if check is _any:
            note = f"accepted, no effect: {why}"
        parser.add_argument(flag, *ALIASES.get(flag, ()), dest=_dest(flag), type=check,
                            default=None, help=f"vLLM's flag: {note} (default: not given)")
    for flag, refuse in REFUSED.items():
        parser.add_argument(flag, dest=_dest(flag), nargs=0, action=_Refuse, refuse=refuse,
                            default=argparse.SUPPRESS,
                            help="vLLM's flag: refused, with the reason")


def notes(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> list[str]:
    """One line per such flag given: that it changes nothing here, and why; and one naming the
    ``VLLM_*`` variables of ``env`` (default: this process's) that kvengine does not read."""
    out = []
    environment = environment_note(os.environ if env is None else env)
    if environment is not None:
        out.append(environment)
    for flag, why in NO_OP_SWITCHES.items():
        if getattr(args, _dest(flag), False):
            out.append(f"kvengine: {flag} has no effect here: {why}")
    for flag, (check, why) in VALUED.items():
        if getattr(args, _dest(flag), None) is None:
            continue
        if check is _any:
            out.append(f"kvengine: {flag} has no effect here: {why}")
        else:
            out.append(f"kvengine: {flag} {getattr(args, _dest(flag))} is what kvengine does "
                       f"anyway ({why})")
    return out


class _Refuse(argparse.Action):
    """A switch refused with its reason, in argparse's one line."""

    def __init__(self, *args, refuse: Callable[[str], str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._refuse = refuse

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            self._refuse(option_string or "")
        except argparse.ArgumentTypeError as exc:
            parser.error(f"argument {option_string}: {exc}")


# vLLM's variables kvengine reads as vLLM does (server/http_front_args.py).
HONOURED_VLLM_VARIABLES = frozenset({"VLLM_API_KEY"})


def environment_note(env: Mapping[str, str]) -> str | None:
    """One line naming the ``VLLM_*`` variables set here that kvengine does not read (a moved
    deployment's environment), or None."""
    ignored = sorted(v for v in env if v.startswith("VLLM_") and v not in HONOURED_VLLM_VARIABLES)
    if not ignored:
        return None
    return (f"kvengine: {', '.join('$' + v for v in ignored)} "
            f"{'is a vLLM setting' if len(ignored) == 1 else 'are vLLM settings'} that kvengine "
            "does not read (it reads $VLLM_API_KEY); kvengine's own are $KVENGINE_*")
