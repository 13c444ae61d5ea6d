"""`kvengine router --engine [NAME=]URL`: the name clients see in `x-kvengine-engine` (its
position by default), never an internal address unless `--engine-header url` asks for it."""

from __future__ import annotations

import argparse

import pytest

from server.router.args import EngineAddress, _engine_url, engine_names


def test_an_engine_is_a_url_or_a_named_url() -> None:
    assert _engine_url("http://10.0.0.5:8001/") == EngineAddress("http://10.0.0.5:8001")
    assert _engine_url("gpu-3=http://10.0.0.5:8001") == EngineAddress("http://10.0.0.5:8001",
                                                                      "gpu-3")
    for bad in ("gpu 3=http://h:1", "=http://h:1", "gpu=ftp://h:1", "gpu=http://h:1/v1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _engine_url(bad)


def test_names_default_to_positions_and_stay_unique() -> None:
    engines = [EngineAddress("http://a:1"), EngineAddress("http://b:1", "fast"),
               EngineAddress("http://c:1")]
    assert engine_names(engines) == {"http://a:1": "0", "http://b:1": "fast", "http://c:1": "2"}
    with pytest.raises(ValueError, match="twice"):
        engine_names([EngineAddress("http://a:1"), EngineAddress("http://a:1", "x")])
    with pytest.raises(ValueError, match="share a name"):
        engine_names([EngineAddress("http://a:1", "1"), EngineAddress("http://b:1")])
