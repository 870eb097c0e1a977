"""The W4 scaling plots of ``engine_speed.py`` (``--scaling``, ``--replot``)."""

from __future__ import annotations

from pathlib import Path

W4_PARTICIPATING = (10, 30, 100, 300, 1000)  # of 10,000 clients
W4_TOTAL = (1000, 3000, 10_000, 30_000, 100_000)  # at 100 per round


def plot_w4_scaling(scaling: list[dict], out_dir: Path) -> list[Path]:
    """Two log-log plots: seconds per round against participating clients (of 10,000) and against total
    clients (100 per round), each with the linear / flat reference line through the 100-of-10,000 point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next(s for s in scaling if s["participating"] == 100 and s["total_clients"] == 10_000)
    panels = [
        ("participants", "participating clients per round (of 10,000)", "total_clients", 10_000),
        ("total", "total clients (100 per round)", "participating", 100),
    ]
    paths = []
    for name, xlabel, fixed_key, fixed in panels:
        key = "participating" if name == "participants" else "total_clients"
        pts = sorted(
            (s[key], s["seconds_per_round"], s["samples_per_second"] * s["seconds_per_round"])
            for s in scaling
            if s[fixed_key] == fixed
        )
        xs, ys, _ = zip(*pts, strict=True)
        fig, ax = plt.subplots(figsize=(4.5, 3.4))
        ax.loglog(xs, ys, "o-", label=f"fedskew ({scaling[0]['resolved']})")
        for x, y, n in pts:  # the round's work: with a fixed dataset, more clients means smaller ones
            ax.annotate(f"{n:,.0f}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=6)
        slope = 1.0 if name == "participants" else 0.0
        ax.loglog(
            xs,
            [ref["seconds_per_round"] * (x / ref[key]) ** slope for x in xs],
            "k--",
            lw=0.8,
            label="linear" if slope else "flat",
        )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds per round")
        ax.set_title("W4: FedAvg, MLP, MNIST Dir(0.1); labels: samples per round", fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"engine_w4_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
