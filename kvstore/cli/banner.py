"""The lines ``kvstore serve`` writes once the store is up: the DRAM pool (pinned or why not),
the SSD tier, the control socket, the admin HTTP address, the cluster node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.sizes import format_bytes


def _find(stats: dict, *path: str) -> Any:
    node: Any = stats
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def describe_start(config: Any, stats: dict, socket_path: Path, http_url: str | None) -> str:
    """The store's start-up lines (one per line): DRAM pool, SSD tier, socket, admin HTTP."""
    dram = _find(stats, "tiers", "dram") or {}
    pinned = dram.get("pinned", _find(stats, "dram_pinned"))
    pinned_text = "yes" if pinned else "no" if pinned is not None else "unknown"
    if pinned is False:
        pinned_text += (" (--pin no)" if config.pin_memory is False else
                        f" ({dram['pin_error']}: plain host memory, nothing page-locked)"
                        if dram.get("pin_error") else "")
    lines = [f"kvstore: DRAM pool {format_bytes(config.dram_bytes)} ({config.dram_bytes} bytes), "
             f"pinned: {pinned_text}"]
    if config.ssd_dir is not None and config.ssd_bytes > 0:
        ssd = _find(stats, "tiers", "ssd") or {}
        io_mode = ssd.get("io_mode") or ("O_DIRECT" if ssd.get("direct_io") else
                                         "buffered" if "direct_io" in ssd else "unknown")
        lines.append(f"kvstore: SSD tier {config.ssd_dir}, {format_bytes(config.ssd_bytes)}, "
                     f"IO mode {io_mode}, {ssd.get('blocks', 0)} blocks recovered")
    else:
        lines.append("kvstore: SSD tier off")
    lines.append(f"kvstore: listening on {socket_path} (control socket)")
    lines.append(f"kvstore: admin HTTP {http_url or 'off'}")
    return "\n".join(lines)


def describe_cluster(config: Any, node: Any, registered: bool) -> str:
    """The cluster node's start-up line: its id, the address peers dial, Redis's state."""
    listen = f"{config.listen_host}:{node.server.port}"
    redis_state = "registered" if registered else "unreachable, serving locally until it answers"
    return (f"kvstore: cluster node {config.node_id}, peers dial {node.addr} (UCX listens on "
            f"{listen}, port open on every interface), Redis {config.redis_host}:"
            f"{config.redis_port}/{config.redis_db}: {redis_state}")
