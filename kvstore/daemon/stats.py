"""The daemon's ``stats`` reply: the store's stats, per-tier misses, the HBM tier, the daemon's
own counters and the cluster's, merged into one dict."""

from __future__ import annotations


def merge_stats(store_stats: dict, daemon: dict, hbm: dict,
                cluster: tuple[dict, dict] | None) -> dict:
    """The store's stats plus ``daemon``, ``tiers.hbm`` and (with a cluster) ``tiers.remote``
    and ``cluster``."""
    out = dict(store_stats)
    add_tier_misses(out)
    out["daemon"] = daemon
    tiers = out.get("tiers")
    if isinstance(tiers, dict):
        tiers["hbm"] = hbm
    if cluster is not None:
        remote, cluster_stats = cluster
        if isinstance(tiers, dict):
            tiers["remote"] = remote
        out["cluster"] = cluster_stats
    return out


def add_tier_misses(stats: dict) -> None:
    """Per-tier misses where the store reports only per-tier hits and one miss total.

    Tiers are asked in order (DRAM, then SSD): a block a tier did not have fell through it, so
    DRAM misses = SSD hits + final misses, and SSD misses = final misses (SSD on) or 0.
    """
    tiers, counters = stats.get("tiers"), stats.get("counters") or {}
    if not isinstance(tiers, dict) or "miss_blocks" not in counters:
        return
    final = counters["miss_blocks"]
    ssd = tiers.get("ssd") if isinstance(tiers.get("ssd"), dict) else None
    ssd_on = bool(ssd and ssd.get("enabled", True) and ssd.get("capacity_bytes"))
    if isinstance(tiers.get("dram"), dict):
        ssd_hits = ssd.get("hits", 0) if ssd else 0
        tiers["dram"].setdefault("misses", ssd_hits + final)
    if ssd is not None:
        ssd.setdefault("misses", final if ssd_on else 0)
