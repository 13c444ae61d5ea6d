"""ClusterConfig: the CLI strings of `kvstore serve --cluster ...` validated once.

No Redis or UCX needed: not marked `cluster`.
"""

from __future__ import annotations

import pytest

from kvstore.cluster.config import ClusterConfig, format_host_port, parse_host_port


def test_from_args_parses_every_flag():
    config = ClusterConfig.from_args("redis://10.0.0.5:6380/2", node_id="gpu-7",
                                     listen="0.0.0.0:7400", advertise="10.0.0.9:7400")
    assert (config.redis_host, config.redis_port, config.redis_db) == ("10.0.0.5", 6380, 2)
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", 7400)
    assert config.advertise_addr(7400) == "10.0.0.9:7400"
    assert config.suspect_s == config.node_ttl_s


def test_advertise_follows_listen_and_the_bound_port():
    config = ClusterConfig.from_args("redis://localhost:6379", node_id="a")
    assert config.redis_db == 0
    assert config.advertise_addr(41234) == "127.0.0.1:41234"
    config = ClusterConfig.from_args("redis://h:1/0", node_id="a", listen="[::1]:0")
    assert config.advertise_addr(5) == "[::1]:5"


@pytest.mark.parametrize(("text", "host", "port"), [
    ("127.0.0.1:80", "127.0.0.1", 80), ("node-3.local:0", "node-3.local", 0),
    ("[fe80::1]:9", "fe80::1", 9)])
def test_host_port_round_trip(text, host, port):
    assert parse_host_port(text, "--listen") == (host, port)
    assert format_host_port(host, port) == text


@pytest.mark.parametrize("text", ["127.0.0.1", ":80", "h:", "h:http", "h:70000", "::1:80",
                                  "[::1]80"])
def test_bad_host_port_names_the_flag(text):
    with pytest.raises(ValueError, match="--listen"):
        parse_host_port(text, "--listen")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"redis_url": "http://h:1/0"}, "redis://"),
    ({"redis_url": "redis://h/0"}, "HOST and PORT"),
    ({"redis_url": "redis://h:x/0"}, "port"),
    ({"redis_url": "redis://h:1/db"}, "database"),
    ({"node_id": "a b"}, "--node-id"),
    ({"node_id": ""}, "--node-id"),
    ({"listen_host": "0.0.0.0"}, "--advertise"),
    ({"advertise_host": "0.0.0.0"}, "--advertise"),
    ({"node_ttl_s": 1.0, "heartbeat_interval_s": 1.0}, "twice"),
    ({"remote_timeout_s": 0}, "remote_timeout_s"),
    ({"key_prefix": "a b"}, "key_prefix"),
])
def test_bad_config_is_refused_with_a_clear_error(kwargs, message):
    base = {"redis_url": "redis://127.0.0.1:6379/0", "node_id": "a"}
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**{**base, **kwargs})
