"""The core's answers to bad input: settings refused once, a reply's unknown tier or outcome
read fail-closed, a save whose lists disagree refused before anything is pinned."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.block_manager import BlockManager
from kvstore import Tier
from offload.core.restorer import RestoreSettings, known_tiers
from offload.core.saver import Saver
from offload.core.states import SaveOutcome
from offload.ledger_site import LedgerSite
from offload.store_client import StoreClient


def test_settings_are_checked_once() -> None:
    RestoreSettings()
    with pytest.raises(ValueError, match="max_lookup_wait_s"):
        RestoreSettings(max_lookup_wait_s=-1.0)
    with pytest.raises(ValueError, match="shorter than the lease"):
        RestoreSettings(lease_ttl_s=5.0, max_slot_wait_s=5.0)


def test_a_tier_this_client_does_not_know_ends_the_hit_there() -> None:
    assert known_tiers(["hbm", "dram", "ssd"]) == [Tier.HBM, Tier.DRAM, Tier.SSD]
    assert known_tiers(["dram", "tape", "dram"]) == [Tier.DRAM]
    assert known_tiers([]) == []


def test_an_unknown_save_outcome_counts_as_failed() -> None:
    assert SaveOutcome.parse("saved") is SaveOutcome.SAVED
    assert SaveOutcome.parse("duplicate").stored
    for odd in ("SAVED", "", None, 3):
        assert SaveOutcome.parse(odd) is SaveOutcome.FAILED
        assert not SaveOutcome.parse(odd).stored


def test_a_save_whose_lists_disagree_is_refused_before_pinning(tmp_path) -> None:
    ledger = BlockManager(8, 16)
    client = StoreClient(tmp_path / "no-daemon.sock", None, "core-inputs", 1.0, 1.0,
                         connect_wait_s=0.0)
    try:
        saver = Saver(client, LedgerSite(ledger, Counter()), Counter())
        with pytest.raises(ValueError, match="2 block ids, 1 hashes"):
            saver.pin(b"n" * 16, [0, 1], [b"h" * 16], [b"i", b"j"])
        assert ledger.num_free_blocks == 8 and not saver.pinned  # nothing was pinned
        # No store: skipped and counted, nothing pinned.
        assert saver.pin(b"n" * 16, [0], [b"h" * 16], [b"i"]) is None
        assert saver.counters["blocks_save_skipped_unavailable"] == 1
        assert ledger.num_free_blocks == 8
    finally:
        client.close()
