"""``json_containers_over``: objects and arrays outside strings, counted in linear time whatever
the body (it runs on the event loop, before the body is parsed)."""

from __future__ import annotations

import json

import pytest

from server.body_limit import json_containers_over

pytestmark = pytest.mark.timeout(30)


def test_brackets_inside_strings_do_not_count() -> None:
    text = 'a "quoted" \\ back {[ ] } \\"x' * 10
    body = json.dumps({"messages": [{"role": "user", "content": text}] * 300}).encode()
    assert json_containers_over(body, 300) == 302  # the body, its list and the 300 messages
    assert json_containers_over(body, 302) is None


def test_an_unterminated_string_of_escaped_quotes_is_scanned_in_linear_time() -> None:
    """Past the bracket pre-check, a string left open and full of escaped quotes made the old
    pattern fail and restart at each quote: quadratic, hours for 4 MB on the event loop."""
    body = b"[" * 20_001 + b'"' + b'\\"' * 1_000_000
    assert json_containers_over(body, 20_000) == 20_001
