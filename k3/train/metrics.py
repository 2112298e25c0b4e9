"""Training metrics: one JSON object per line in metrics.jsonl, and a PNG plot of the curves."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

from k3.atomic import atomic_write_bytes


class MetricsLog:
    """Appends records to DIR/metrics.jsonl. On resume, records past the checkpoint's step are dropped first,
    so the file reads as one unbroken run."""

    def __init__(self, path: str | os.PathLike, keep_through_step: int | None = None) -> None:
        self.path = Path(path)
        if keep_through_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= keep_through_step]
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))
        elif keep_through_step is None and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        if any(v is None for k, v in clean.items() if record.get(k) is not None):
            clean["non_finite"] = sorted(k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v))
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(clean) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records


def metric_series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a number under `key`."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def figure_grid():
    """(figure, 2x2 axes) of a metrics plot, drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(2, 2, figsize=(10, 7))


def save_figure(fig, png_path: str | os.PathLike) -> None:
    """The figure as a PNG, written atomically (a reader never sees half a plot), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    atomic_write_bytes(png_path, buffer.getvalue())


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> None:
    """Loss (train and validation), learning rate, tokens/s and maxvio against step, in one PNG."""
    records = read_metrics(metrics_path)
    fig, axes = figure_grid()
    ax = axes[0][0]
    ax.plot(*metric_series(records, "loss"), label="train", linewidth=1)
    ax.plot(*metric_series(records, "val_loss"), "o-", label="validation")
    ax.set_title("loss (nats/token)")
    ax.legend()
    for ax, key, title in ((axes[0][1], "lr", "learning rate"), (axes[1][0], "tokens_per_s", "tokens/s"),
                           (axes[1][1], "maxvio", "MoE maxvio (max over layers)")):
        ax.plot(*metric_series(records, key), linewidth=1)
        ax.set_title(title)
    for ax in axes.flat:
        ax.set_xlabel("step")
    save_figure(fig, png_path)
