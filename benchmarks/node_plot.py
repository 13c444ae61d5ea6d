"""A node run's TTFT over time, one panel per configuration (``benchmarks.node --plot``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_ttft(points: dict[str, dict], order: Sequence[str], path: Path, title: str) -> Path:
    """TTFT over the run per configuration (first turns and later turns apart, ``order``'s
    configurations that ran), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in order if c in points and not points[c].get("error")]
    fig, axes = plt.subplots(len(configs), 1, figsize=(9, 2.4 * len(configs)), sharex=True,
                             squeeze=False)
    for ax, config in zip(axes[:, 0], configs):
        records = [r for r in points[config]["records"] if r["error"] is None]
        for later, style in ((False, "o"), (True, "x")):
            xs = [r["sent_s"] for r in records if bool(r["round"]) == later]
            ys = [r["ttft_s"] * 1e3 for r in records if bool(r["round"]) == later]
            ax.plot(xs, ys, style, markersize=4, label="later turns" if later else "first turns")
        ax.set_yscale("log")
        ax.set_ylabel("TTFT ms")
        ax.set_title(config, fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("sent at (s into the run)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
