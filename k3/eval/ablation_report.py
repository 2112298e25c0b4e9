"""The report of `k3 ablate`: per axis a table of every arm (mean over seeds, with the min-max spread) and
plots (validation loss curves with their spread band; MQAR accuracy and maxvio by arm)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from k3.atomic import atomic_write_bytes

METRICS = (("val_loss", "val loss", "{:.4f}"), ("mqar_trained", "MQAR @L", "{:.3f}"), ("mqar_4x", "MQAR @4L", "{:.3f}"),
           ("maxvio_mean", "maxvio mean", "{:.3f}"), ("maxvio_p99", "maxvio p99", "{:.3f}"),
           ("tokens_per_s", "tokens/s", "{:.0f}"))


def summarise(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(axis, arm) -> {metric: (mean, min, max)} and the seeds it holds, in plan order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["axis"], row["arm"]), []).append(row)
    summary = {}
    for key, members in groups.items():
        stats = {}
        for name, _, _ in METRICS:
            values = [m[name] for m in members if m.get(name) is not None]
            stats[name] = (float(np.mean(values)), float(np.min(values)), float(np.max(values))) if values else None
        summary[key] = {"stats": stats, "seeds": len(members), "chance": members[0].get("mqar_chance")}
    return summary


def _cell(stat, fmt: str) -> str:
    if stat is None:
        return "-"
    mean, low, high = stat
    if high - low < 1e-12:
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{fmt.format(low)}, {fmt.format(high)}]"


def markdown_tables(rows: list[dict]) -> str:
    summary = summarise(rows)
    lines = []
    for axis in dict.fromkeys(r["axis"] for r in rows):
        arms = [key for key in summary if key[0] == axis]
        lines.append(f"### {axis}\n")
        lines.append("| arm | seeds | " + " | ".join(label for _, label, _ in METRICS) + " |")
        lines.append("|---|---|" + "---|" * len(METRICS))
        for key in arms:
            entry = summary[key]
            cells = [_cell(entry["stats"][name], fmt) for name, _, fmt in METRICS]
            lines.append(f"| {key[1]} | {entry['seeds']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_axis(rows: list[dict], axis: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["axis"] == axis]
    arms = list(dict.fromkeys(r["arm"] for r in mine))
    fig, (curve_ax, mqar_ax, vio_ax) = plt.subplots(1, 3, figsize=(14, 3.8))
    for arm in arms:
        curves = [r["val_curve"] for r in mine if r["arm"] == arm]
        steps = [s for s, _ in curves[0]]
        values = np.array([[v for _, v in c][:len(steps)] for c in curves if len(c) >= len(steps)])
        line, = curve_ax.plot(steps, values.mean(0), label=arm)
        curve_ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2, color=line.get_color())
    curve_ax.set_xlabel("step")
    curve_ax.set_ylabel("validation loss")
    curve_ax.set_title(f"{axis}: validation loss (band: min-max over seeds)", fontsize=9)
    curve_ax.legend(fontsize=7)
    summary = summarise(mine)
    x = np.arange(len(arms))
    for offset, (name, label) in zip((-0.2, 0.2), (("mqar_trained", "at the trained length"), ("mqar_4x", "at 4x"))):
        means = [summary[(axis, a)]["stats"][name][0] for a in arms]
        errors = np.array([[summary[(axis, a)]["stats"][name][0] - summary[(axis, a)]["stats"][name][1],
                            summary[(axis, a)]["stats"][name][2] - summary[(axis, a)]["stats"][name][0]] for a in arms]).T
        mqar_ax.bar(x + offset, means, width=0.4, yerr=errors, label=label, capsize=3)
    chance = summary[(axis, arms[0])]["chance"]
    if chance:
        mqar_ax.axhline(chance, color="gray", linestyle=":", label="chance")
    mqar_ax.set_xticks(x, arms, rotation=20, fontsize=7)
    mqar_ax.set_ylabel("MQAR accuracy")
    mqar_ax.legend(fontsize=7)
    means = [summary[(axis, a)]["stats"]["maxvio_mean"][0] for a in arms]
    p99 = [summary[(axis, a)]["stats"]["maxvio_p99"][0] for a in arms]
    vio_ax.bar(x - 0.2, means, width=0.4, label="mean")
    vio_ax.bar(x + 0.2, p99, width=0.4, label="p99")
    vio_ax.set_xticks(x, arms, rotation=20, fontsize=7)
    vio_ax.set_ylabel("maxvio of the routed batches")
    vio_ax.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def write_report(rows: list[dict], settings, out: Path, trained: int) -> Path:
    """OUT/report.md (tables) and OUT/<axis>.png, for recall trained at length `trained`; returns the report
    path."""
    tables = markdown_tables(rows)
    queries = settings.recall_queries or settings.recall_pairs
    packed = (f" ({settings.seq_len // (trained + 1)} per row)" if trained < settings.seq_len else "")
    weight = f", answers weighted {settings.recall_weight:g}x in the loss" if settings.recall_weight != 1 else ""
    header = (f"# Ablation: base preset `{settings.base}`, {settings.steps} steps of {settings.batch_size} x "
              f"{settings.seq_len} tokens, {settings.seeds} seed(s)\n\nCells: mean over seeds [min, max]. MQAR: "
              f"{settings.recall_pairs} pairs, {queries} queries; training rows: {settings.recall_fraction:g} of them "
              f"recall sequences of {trained} tokens{packed}{weight}; measured at the trained length {trained} and at "
              f"{4 * trained}. maxvio: of the routed training batches after warm-up.\n\n")
    report = out / "report.md"
    atomic_write_bytes(report, (header + tables + "\n").encode("utf-8"))
    for axis in dict.fromkeys(r["axis"] for r in rows):
        plot_axis(rows, axis, out / f"{axis}.png")
    return report
