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
    assert "--max-request-body-bytes" in text and "(default: 4194304 = 4 MiB)" in text
    assert "(default: 1024, lowered to fit the open-file limit)" in text
    assert "--metrics-key" in text and "$KVENGINE_METRICS_KEY" in text
    assert "(default: 5.0)" in text and "(default: 30.0)" in text
