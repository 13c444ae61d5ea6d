"""`kvengine serve`'s limit flags: bad values exit 2 with a message, help shows the defaults."""

from __future__ import annotations

import pytest

from server.cli import main


@pytest.mark.parametrize(("args", "needle"), [
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
    (["--max-request-body-bytes", "4MiB"], "--max-request-body-bytes"),
    (["--max-connections", "-3"], "--max-connections"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive"),
    (["--request-read-timeout", "soon"], "--request-read-timeout"),
    (["--api-key", "same", "--metrics-key", "same"], "metrics key must differ"),
])
def test_bad_limit_flags_exit_2_with_a_message(tiny_model_dir, capsys, args, needle) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tiny_model_dir), *args])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    # Each flag's help names its default (the wording is free).
    for flag, default in (("--max-request-body-bytes", "4194304"), ("--max-connections", "1024"),
                          ("--metrics-key", "KVENGINE_METRICS_KEY"),
                          ("--timeout-keep-alive", "5.0"), ("--request-read-timeout", "30.0")):
        after = text.split(flag + " ", 2)[-1]  # the option's own entry, not the usage line
        entry = after.split(" --", 1)[0]
        assert default in entry, (flag, entry)
