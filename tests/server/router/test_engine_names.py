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


@pytest.mark.parametrize("text", [
    "0", "=tcp://127.0.0.1:5557", "a b=tcp://h:1", "0=http://127.0.0.1:5557",
    "0=tcp://127.0.0.1", "0=tcp://h:1,http://h:2", "0=tcp://h:1,", "0=tcp://h:1 ,tcp://h:2",
])
def test_a_kv_events_address_that_is_not_one_is_refused(text: str) -> None:
    from server.router.args import _events_address

    with pytest.raises(argparse.ArgumentTypeError, match="ENGINE=ENDPOINT"):
        _events_address(text)


def test_kv_events_name_engines_that_exist_once() -> None:
    from server.router.args import EventsAddress, _events_address, events_by_url

    engines = [EngineAddress("http://a:1", "a"), EngineAddress("http://b:1")]
    got = events_by_url(engines, [_events_address("a=tcp://h:5557,tcp://h:5558"),
                                  _events_address("1=ipc:///tmp/ev")])
    assert got == {"http://a:1": EventsAddress("a", "tcp://h:5557", "tcp://h:5558"),
                   "http://b:1": EventsAddress("1", "ipc:///tmp/ev", None)}
    with pytest.raises(ValueError, match="no --engine has that name"):
        events_by_url(engines, [_events_address("c=tcp://h:1")])
    with pytest.raises(ValueError, match="twice"):
        events_by_url(engines, [_events_address("a=tcp://h:1"), _events_address("a=tcp://h:2")])


def test_a_pool_takes_residencies_only_for_its_engines() -> None:
    import httpx

    from server.router.engine_pool import EngineKind, EnginePool
    from server.router.engine_residency import EngineResidency

    residency = EngineResidency()
    client = httpx.AsyncClient()
    pool = EnginePool(["http://a:1", "http://b:1/"], client, kind="kvengine",
                      residencies={"http://b:1": residency})
    assert pool.engines["http://b:1"].kind is EngineKind.VLLM
    assert pool.engines["http://b:1"].residency is residency
    assert pool.engines["http://a:1"].kind is EngineKind.KVENGINE
    with pytest.raises(ValueError, match="not in the pool"):
        EnginePool(["http://a:1"], client, residencies={"http://c:1": residency})
