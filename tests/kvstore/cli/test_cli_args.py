"""The argparse value types both command lines use accept their range's edges and refuse just
past them, each with a message that names the value."""

from __future__ import annotations

import argparse
import re

import pytest

from kvstore.cli.args import (
    fraction_arg,
    non_negative_int_arg,
    port_arg,
    positive_float_arg,
    positive_int_arg,
    size_arg,
)


@pytest.mark.parametrize(("parse", "text", "want"), [
    (positive_int_arg, "1", 1),
    (non_negative_int_arg, "0", 0),
    (port_arg, "0", 0),
    (port_arg, "65535", 65535),
    (positive_float_arg, "0.001", 0.001),
    (fraction_arg, "1", 1.0),
    (fraction_arg, "0.5", 0.5),
    (size_arg, "1.5GB", 1_500_000_000),
])
def test_values_in_range_are_taken(parse, text, want) -> None:
    assert parse(text) == want


@pytest.mark.parametrize(("parse", "text"), [
    (positive_int_arg, "0"),
    (positive_int_arg, "1.5"),
    (non_negative_int_arg, "-1"),
    (port_arg, "65536"),
    (port_arg, "http"),
    (positive_float_arg, "0"),
    (positive_float_arg, "nan"),
    (fraction_arg, "0"),
    (fraction_arg, "1.01"),
    (size_arg, "4 parsecs"),
])
def test_values_out_of_range_are_refused_with_the_value_named(parse, text) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
        parse(text)
