"""Two nodes on one host, each a `kvstore serve --cluster` daemon with its own `kvengine serve
--kv-offload` (issue 28 item 3, on CPU): a prompt answered on node A is answered on node B from
A's store over UCX (usage tier "remote"), the same greedy answer, counted by B's daemon, with the
UCX transport B reached A by in its stats and its log; a second turn that extends the prompt on A
comes to B as B's own HBM hit plus the new blocks from A. With A's daemon killed, B recomputes:
the same answer, a counted remote error, no failed request. Blocks only A's engine holds (saved
on eviction, not yet evicted) reach B too: A's daemon stages them from the arena into its store
for B's fetch, and withdraws them from the index once they leave the node."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from cluster_parts import daemon_stats, index_caught_up, shm_lanes
from daemon_helpers import RunningDaemon, wait_until
from support.kvengine import KvengineProcess

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

BLOCK_SIZE = 16
rng = np.random.default_rng(28)
PROMPT = rng.integers(10, 1000, BLOCK_SIZE * 10 + 5).tolist()  # 10 full blocks
SECOND_TURN = PROMPT + rng.integers(10, 1000, 66).tolist()  # 14 full blocks
OTHER_PROMPT = rng.integers(10, 1000, BLOCK_SIZE * 6 + 3).tolist()  # 6 full blocks


def _engine(model_dir, daemon: RunningDaemon, *flags: str) -> KvengineProcess:
    return KvengineProcess("--model", str(model_dir), "--num-kv-blocks", "128", "--kv-offload",
                           "--kv-store-socket", str(daemon.socket_path), *flags)


def _complete(engine: KvengineProcess, prompt: list[int]) -> tuple[str, dict[str, int]]:
    """The greedy answer (must be a 200) and the prompt's cached tokens by tier."""
    response = httpx.post(engine.url + "/v1/completions", timeout=60, json={
        "model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    details = body["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == sum(details["cached_tokens_by_tier"].values())
    return body["choices"][0]["text"], details["cached_tokens_by_tier"]


def _saved(daemon: RunningDaemon, num_blocks: int) -> bool:
    """The engine's write-through saves are in the daemon's DRAM and advertised in Redis."""
    return daemon_stats(daemon)["tiers"]["dram"]["blocks"] >= num_blocks and \
        index_caught_up(daemon, num_blocks)


@pytest.fixture
def start_engines(tiny_model_dir):
    """``start_engines(daemon, ...)``: one engine per daemon, started together, each stopped at
    teardown (those that did start, if another failed)."""
    started: list[KvengineProcess] = []

    def start(*daemons: RunningDaemon, flags: tuple[tuple[str, ...], ...] = ()
              ) -> list[KvengineProcess]:
        """``flags[i]``: more flags for the engine of ``daemons[i]``."""
        flags = flags or ((),) * len(daemons)
        with ThreadPoolExecutor(len(daemons)) as pool:
            futures = [pool.submit(_engine, tiny_model_dir, d, *f)
                       for d, f in zip(daemons, flags, strict=True)]
        started.extend(f.result() for f in futures if f.exception() is None)
        return [f.result() for f in futures]

    yield start
    for engine in started:
        engine.stop(signal.SIGTERM)


def test_a_turn_on_node_b_is_served_from_node_a_over_ucx(start_nodes, start_engines):
    a, b = start_nodes("a", "b", flags=("--log-level", "info"))
    engine_a, engine_b = start_engines(a, b)
    # Turn 1: computed on A, then the same prompt to B, whose prefix is only in A's store.
    answer, tiers = _complete(engine_a, PROMPT)
    assert sum(tiers.values()) == 0
    assert wait_until(lambda: _saved(a, 10), 20.0)
    text, tiers = _complete(engine_b, PROMPT)
    assert text == answer
    assert tiers["remote"] == 10 * BLOCK_SIZE
    assert tiers["hbm"] == tiers["dram"] == tiers["ssd"] == 0

    stats = daemon_stats(b)
    assert stats["tiers"]["remote"]["hits"] == 10
    assert stats["cluster"]["remote_hit_blocks"] == 10
    peer = stats["cluster"]["peers"]["a"]
    # The daemons listen on 127.0.0.1: UCX_NET_DEVICES is the loopback device, and UCX
    # picks tcp over it between two processes of this host (and shared memory where allowed).
    assert set(peer["transports"]) == {"tcp/lo", *shm_lanes()}, peer
    assert peer["addr"] == daemon_stats(a)["cluster"]["addr"]
    logged = [line for line in b.lines if "UCX to peer a " in line]
    assert len(logged) == 1 and "tcp/lo" in logged[0], logged

    # Turn 2 extends the prompt on A; on B the old prefix is B's own HBM hit, the 4 new
    # blocks come from A.
    answer, tiers = _complete(engine_a, SECOND_TURN)
    assert tiers["hbm"] == 10 * BLOCK_SIZE
    assert wait_until(lambda: _saved(a, 14), 20.0)
    text, tiers = _complete(engine_b, SECOND_TURN)
    assert text == answer
    assert tiers["hbm"] == 10 * BLOCK_SIZE and tiers["remote"] == 4 * BLOCK_SIZE, tiers
    assert daemon_stats(b)["cluster"]["remote_hit_blocks"] == 14

    # A's daemon dies (no deregistration: Redis still lists it): B recomputes, counted.
    answer, _ = _complete(engine_a, OTHER_PROMPT)
    assert wait_until(lambda: _saved(a, 20), 20.0)
    a.kill9()
    errors_before = daemon_stats(b)["cluster"].get("remote_errors", 0)
    start = time.monotonic()
    text, tiers = _complete(engine_b, OTHER_PROMPT)
    elapsed_s = time.monotonic() - start
    assert text == answer and sum(tiers.values()) == 0, tiers
    assert elapsed_s < 5.0, elapsed_s  # A refuses the connection at once; room for a busy host
    cluster = daemon_stats(b)["cluster"]
    assert cluster["remote_errors"] == errors_before + 1
    assert cluster["remote_errors_unreachable"] >= 1
    assert daemon_stats(b)["tiers"]["remote"]["misses"] >= 6
    assert _complete(engine_b, PROMPT)[1]["hbm"] == 10 * BLOCK_SIZE  # B serves on
    assert not [line for line in engine_b.lines if "Traceback" in line or " ERROR " in line]



def _published(daemon: RunningDaemon) -> int:
    """Blocks the daemon advertises in Redis now."""
    return daemon_stats(daemon)["cluster"]["index"]["published_blocks"]


def test_blocks_only_in_node_as_engine_reach_node_b(start_nodes, start_engines):
    # A's store holds 16 blocks of the tiny model (8 KiB each); its engine's arena 128.
    (a,) = start_nodes("a", flags=("--dram", "128KiB"))
    (b,) = start_nodes("b")
    engine_a, engine_b = start_engines(a, b)
    answer, _ = _complete(engine_a, PROMPT)
    for seed in (1, 2):  # 20 more blocks: the prompt's leave A's store, not A's arena
        _complete(engine_a, np.random.default_rng(seed).integers(10, 1000, 165).tolist())
    assert wait_until(lambda: index_caught_up(a, 30), 20.0)
    stats_a = daemon_stats(a)
    assert stats_a["tiers"]["dram"]["blocks"] <= 16 and stats_a["tiers"]["hbm"]["blocks"] >= 30
    assert _published(a) == 30  # the dropped blocks stay advertised: the arena holds them

    text, tiers = _complete(engine_b, PROMPT)
    assert text == answer
    assert tiers["remote"] == 10 * BLOCK_SIZE, tiers
    stats_a = daemon_stats(a)
    assert stats_a["tiers"]["hbm"]["counters"]["blocks_staged"] == 10
    assert stats_a["cluster"]["server"]["blocks_staged"] == 10
    assert daemon_stats(b)["cluster"]["remote_hit_blocks"] == 10

    # A's engine goes: what only its arena held is withdrawn, what A's store holds stays.
    engine_a.stop(signal.SIGTERM)
    assert wait_until(lambda: daemon_stats(a)["tiers"]["hbm"]["blocks"] == 0, 20.0)
    assert wait_until(lambda: index_caught_up(a, 0)
                      and _published(a) == daemon_stats(a)["tiers"]["dram"]["blocks"], 20.0)
