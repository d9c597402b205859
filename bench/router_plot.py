"""The routing benchmark's plot: per workload, hit rate / H*, TTFT p50 and TTFT p99 of every
routing setup side by side (and, for a kill run, the hit rate per window around the kill)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# (panel title, the cell's key, and the key inside it or None)
PANELS = (
    ("hit rate / H*", "hit_rate_over_ideal", None),
    ("TTFT p50 (ms)", "ttft_ms", "p50"),
    ("TTFT p99 (ms)", "ttft_ms", "p99"),
)


def _value(cell: dict[str, Any], key: str, sub: str | None) -> float:
    v = cell[key] if sub is None else cell[key][sub]
    return float(v)


def write_plot(path: Path, result: dict[str, Any]) -> bool:
    """One row per workload, one bar per setup in each panel; False (and a line saying so)
    when matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot")
        return False
    workloads = result["workloads"]
    kill = any("kill" in c for w in workloads.values() for c in w["setups"].values())
    cols = len(PANELS) + int(kill)
    fig, axes = plt.subplots(
        len(workloads), cols, figsize=(4.5 * cols, 3.2 * len(workloads)), squeeze=False
    )
    for row, (name, data) in enumerate(workloads.items()):
        labels = list(data["setups"])
        for col, (title, key, sub) in enumerate(PANELS):
            ax = axes[row][col]
            ax.bar(range(len(labels)), [_value(data["setups"][s], key, sub) for s in labels])
            ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=7)
            ax.set_title(f"{name}: {title}", fontsize=9)
        if kill:
            plot_windows(axes[row][-1], name, data)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_windows(ax: Any, name: str, data: dict[str, Any]) -> None:
    """The cluster's hit rate per window and the window's ideal, with the kill marked."""
    for label, cell in data["setups"].items():
        k = cell.get("kill")
        if k is None:
            continue
        starts = [w["start_s"] for w in k["windows"]]
        ax.step(starts, [w["hit_rate"] for w in k["windows"]], where="post", label=label)
        ideal = [w["ideal"] if not math.isnan(w["ideal"]) else None for w in k["windows"]]
        ax.step(starts, ideal, where="post", linestyle=":", label="ideal")
        if k.get("killed_at_s") is not None:
            ax.axvline(k["killed_at_s"], color="red", linewidth=0.8)
    ax.set_title(f"{name}: hit rate per window (kill in red)", fontsize=9)
    ax.set_xlabel("s since start", fontsize=8)
    ax.legend(fontsize=7)
