"""An engine with --kv-offload and a real daemon's key filter: a prompt whose blocks past the HBM
hit no tier holds (a new conversation) is admitted without a lookup, prefilled in its first
step; blocks another engine saved are still looked up and restored; with ``--key-filter off``,
with truncated hashes (not authoritative) or a filter the engine cannot read, every prefix is
asked about as before. (After a restart the filter holds the SSD's blocks:
``test_offload_engine.py::test_restore_from_ssd_after_daemon_restart`` restores through it.)"""

from __future__ import annotations

import re

import httpx
from offload_helpers import GREEDY, close_llm, offload_llm, random_prompt, store_through_an_engine

from kvstore import Client
from kvstore.key_filter import key_filter_path

PROMPT = random_prompt(1000, 16 * 6 + 5, seed=61)  # 6 full blocks


def _lookups(daemon) -> int:
    with Client(daemon.socket_path) as client:
        return client.stats()["counters"]["lookups"]


def _hello_filter(daemon) -> dict | None:
    """The key filter the daemon's hello names."""
    with Client(daemon.socket_path) as client:
        client.health()
        return client.key_filter_info


def _generate_once(model_dir, daemon) -> tuple[dict, dict]:
    """One engine answers PROMPT: (its offload counters, its store client's counters)."""
    llm = offload_llm(model_dir, daemon)
    try:
        llm.generate([PROMPT], GREEDY)
        return dict(llm.engine.offload.counters), dict(llm.engine.offload.client.counters)
    finally:
        close_llm(llm)


def test_a_prompt_no_tier_holds_is_admitted_without_a_lookup(tiny_model_dir,
                                                            make_daemon) -> None:
    daemon = make_daemon(dram="64MiB")
    llm = offload_llm(tiny_model_dir, daemon)
    try:
        engine = llm.engine
        assert engine.offload.client.wait_available(10.0)
        engine.add_request("new", PROMPT, GREEDY)
        first = engine.step()
        counters = dict(engine.offload.counters)
        connector = dict(engine.offload.client.counters)
    finally:
        close_llm(llm)
    assert [out.request_id for out in first] == ["new"]  # prefilled in its first step
    assert counters["lookups_skipped_absent"] == 1
    assert counters.get("lookups_at_arrival", 0) == 0 and connector.get("lookups", 0) == 0
    assert connector["key_filter_mapped"] == 1
    assert _lookups(daemon) == 0


def test_blocks_another_engine_saved_are_looked_up_and_restored(tiny_model_dir,
                                                                make_daemon) -> None:
    daemon = make_daemon(dram="64MiB", http=True)
    store_through_an_engine(tiny_model_dir, daemon, [PROMPT])
    reader = offload_llm(tiny_model_dir, daemon)
    try:
        out = reader.generate([PROMPT + [7, 8, 9]], GREEDY)[0]
        counters = dict(reader.engine.offload.counters)
    finally:
        close_llm(reader)
    assert out.cached_tokens_by_tier["dram"] == 6 * 16
    assert counters.get("lookups_skipped_absent", 0) == 0
    text = httpx.get(f"{daemon.http_url}/metrics", timeout=10).text  # the six saved hashes
    added = re.search(r"^kvstore_key_filter_added_total (\S+)$", text, re.M)
    assert added is not None and float(added.group(1)) >= 6
    assert re.search(r"^kvstore_key_filter_false_positive_estimate \S+$", text, re.M)


def test_with_the_filter_off_every_prefix_is_asked_about(tiny_model_dir, make_daemon) -> None:
    daemon = make_daemon("--key-filter", "off", dram="64MiB")
    assert not key_filter_path(daemon.socket_path).exists()
    assert _hello_filter(daemon) is None
    counters, _ = _generate_once(tiny_model_dir, daemon)
    assert counters.get("lookups_skipped_absent", 0) == 0
    assert _lookups(daemon) == 1


def test_truncated_hashes_make_the_filter_not_authoritative(tiny_model_dir,
                                                            make_daemon) -> None:
    # a truncated hash collides on purpose: a probe by the full hash could miss its bits
    daemon = make_daemon(dram="64MiB", env={"KVSTORE_DEBUG_HASH_BITS": "12"})
    assert _hello_filter(daemon)["authoritative"] is False
    _, connector = _generate_once(tiny_model_dir, daemon)
    assert connector.get("key_filter_mapped", 0) == 0
    assert _lookups(daemon) == 1


def test_a_filter_the_engine_cannot_read_leaves_every_lookup_in(tiny_model_dir,
                                                                make_daemon) -> None:
    daemon = make_daemon(dram="64MiB")
    key_filter_path(daemon.socket_path).unlink()  # gone before the engine connects
    _, connector = _generate_once(tiny_model_dir, daemon)
    assert connector["key_filter_unusable"] == 1
    assert _lookups(daemon) == 1
