"""Pictures and tables of a partition: a clients × classes heatmap with client sizes, and table rows.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so it works headless
and never opens a window.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedskew.data.federated import FederatedData

#: annotate heatmap cells with their counts when the grid is at most this many cells
_ANNOTATE_CELLS = 200


def _annotate(ax: Any, counts: np.ndarray) -> None:
    """Write each non-empty cell's count on it (at most ``_ANNOTATE_CELLS`` labels)."""
    hi = counts.max(initial=0)
    for i, c in zip(*np.nonzero(counts), strict=True):
        color = "black" if counts[i, c] > 0.6 * hi else "white"
        ax.text(c, i, str(counts[i, c]), ha="center", va="center", fontsize=7, color=color)


def plot_partition(fd: FederatedData, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Write a PNG: training samples per client (rows) and class (columns), and each client's size.

    Colour uses a square-root scale so that small counts stay visible; empty cells are white. Returns the
    written path (parent folders are created).
    """
    counts = fd.class_counts().numpy()
    n_clients, n_classes = counts.shape
    sizes = counts.sum(1)
    test_sizes = np.array([len(t) for t in fd.test_idx]) if fd.test_idx else np.zeros(n_clients, int)

    height = float(np.clip(1.2 + 0.22 * n_clients, 2.8, 9.0))
    width = float(np.clip(3.6 + 0.35 * n_classes, 6.0, 12.0))
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax, bar = fig.subplots(1, 2, sharey=True, width_ratios=[4, 1])

    shown = np.ma.masked_equal(counts, 0)
    image = ax.imshow(
        shown,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        norm=PowerNorm(0.5, vmin=0, vmax=max(int(counts.max(initial=0)), 1)),
    )
    ax.set_facecolor("white")
    if n_clients * n_classes <= _ANNOTATE_CELLS:
        _annotate(ax, counts)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=min(n_classes, 20), integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=min(n_clients, 25), integer=True))
    fig.colorbar(image, ax=ax, location="left", pad=0.02, shrink=0.9, label="train samples")

    y = np.arange(n_clients)
    bar.barh(y, sizes, height=0.8, color="#4c72b0", label="train")
    if test_sizes.sum():
        bar.barh(y, test_sizes, height=0.35, color="#dd8452", label="test")
    bar.set_xlabel("samples")
    bar.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=7, frameon=False)
    bar.tick_params(axis="y", labelleft=False)
    bar.xaxis.set_major_locator(MaxNLocator(nbins=3, integer=True))

    name = fd.partition.get("name", "?")
    opts = ", ".join(f"{k}={v}" for k, v in fd.partition.items() if k != "name")
    fig.suptitle(
        title or f"{fd.dataset.name}: {name}({opts}), {n_clients} clients, seed {fd.seed}", fontsize=10
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def partition_table(fd: FederatedData, *, max_rows: int = 50) -> list[dict[str, str]]:
    """Rows for a rich table: client, train / val / test sizes, number of classes, top classes (domains).

    All values are strings and every row has the same keys. Beyond ``max_rows`` clients the middle is elided
    with a ``…`` row; a final ``all`` row gives the totals.
    """
    raw = fd.summary_table()
    rows = [
        {
            "client": str(r["client"]),
            "train": str(r["train"]),
            "val": str(r["val"]),
            "test": str(r["test"]),
            "#classes": str(r["classes"]),
            "top classes (class:count)": " ".join(f"{c}:{n}" for c, n in r["top_classes"]),
            **({"domains": ",".join(map(str, r["domains"]))} if "domains" in r else {}),
        }
        for r in raw
    ]
    if len(rows) > max_rows:
        head = max_rows // 2
        rows = [*rows[:head], dict.fromkeys(rows[0], "…"), *rows[len(rows) - (max_rows - head) :]]
    counts = fd.class_counts()
    total = counts.sum(0)
    top = np.argsort(-total.numpy(), kind="stable")[:3]
    rows.append(
        {
            **dict.fromkeys(rows[0], ""),
            "client": "all",
            "train": str(sum(r["train"] for r in raw)),
            "val": str(sum(r["val"] for r in raw)),
            "test": str(sum(r["test"] for r in raw)),
            "#classes": str(int((total > 0).sum())),
            "top classes (class:count)": " ".join(f"{c}:{int(total[c])}" for c in top if total[c] > 0),
        }
    )
    return rows
