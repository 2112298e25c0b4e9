"""Reports of `k3 eval`: an accuracy-by-length table, PNG plots and the JSON rows.

Accuracy rows are {"task", "length", "accuracy", "n"}; perplexity rows come from PositionBucket.row().
"""

from __future__ import annotations

import json
from pathlib import Path

from k3.atomic import atomic_write_bytes
from k3.plotting import pyplot, save_png


def format_length(length: int) -> str:
    """1024 -> 1K, 1048576 -> 1M; other numbers as they are."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if length >= size and length % size == 0:
            return f"{length // size}{unit}"
    return str(length)


MAX_LENGTH = 64 << 20  # tokens; far past any context a model here runs, short of an allocation that cannot work


def parse_lengths(text: str) -> list[int]:
    """"1K,4K,64K,1M" -> [1024, 4096, 65536, 1048576] (K = 1024, M = 1024**2; plain numbers too)."""
    lengths = []
    for part in text.split(","):
        part = part.strip().upper()
        if not part:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(part[-1], 1)
        digits = part[:-1] if scale > 1 else part
        try:
            value = int(float(digits) * scale)
        except (ValueError, OverflowError):  # OverflowError: inf, 1e400
            raise ValueError(f"cannot read length {part!r}; write lengths like 512,1K,4K,64K,1M") from None
        if value < 2:
            raise ValueError(f"length {part!r} is too short; give at least 2 tokens")
        if value > MAX_LENGTH:
            raise ValueError(f"length {part!r} is {value:,} tokens; the most k3 eval takes is {MAX_LENGTH:,} "
                             f"(64M)")
        lengths.append(value)
    if not lengths:
        raise ValueError("no lengths given; write lengths like 1K,4K,16K")
    return lengths


def accuracy_table(rows: list[dict]) -> str:
    """Tasks down, lengths across: accuracy (n)."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cell = {(r["task"], r["length"]): r for r in rows}
    width = max(len("task"), *(len(t) for t in tasks))
    header = f"{'task':<{width}}  " + "  ".join(f"{format_length(n):>12}" for n in lengths)
    lines = [header, "-" * len(header)]
    for task in tasks:
        cells = []
        for n in lengths:
            r = cell.get((task, n))
            cells.append(f"{r['accuracy']:>6.3f} ({r['n']:>3})" if r else f"{'-':>12}")
        lines.append(f"{task:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def cost_table(results) -> str:
    """What each task cost at each length: wall seconds and, on CUDA, peak memory (TaskResult fields)."""
    lines = [f"{'task':<18} {'length':>7} {'seconds':>9} {'peak GiB':>9}"]
    for r in results:
        peak = f"{r.peak_gib:>9.1f}" if r.peak_gib is not None else f"{'-':>9}"
        lines.append(f"{r.task:<18} {format_length(r.length):>7} {r.seconds:>9.2f} {peak}")
    return "\n".join(lines)


def perplexity_table(rows: list[dict]) -> str:
    lines = [f"{'length':>8}  {'positions':>17}  {'loss':>7}  {'ppl':>9}  {'tokens':>9}  source"]
    for r in rows:
        span = f"[{r['position_start']}, {r['position_end']})"
        lines.append(f"{format_length(r['length']):>8}  {span:>17}  {r['loss']:>7.4f}  {r['perplexity']:>9.2f}  "
                     f"{r['n_tokens']:>9}  {r['source']}")
    return "\n".join(lines)


def write_json(path: str | Path, rows: list[dict]) -> None:
    atomic_write_bytes(Path(path), (json.dumps(rows, indent=1) + "\n").encode("utf-8"))


def plot_accuracy(rows: list[dict], path: str | Path, title: str = "accuracy by length") -> None:
    """One line per task, accuracy against length (log axis); written atomically as PNG."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = sorted((r for r in rows if r["task"] == task), key=lambda r: r["length"])
        ax.plot([r["length"] for r in mine], [r["accuracy"] for r in mine], marker="o", label=task)
    lengths = sorted({r["length"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [format_length(n) for n in lengths])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)


def plot_perplexity(rows: list[dict], path: str | Path) -> None:
    """Loss against position (bucket midpoints, log axis), one line per window length."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        ax.plot([(r["position_start"] + r["position_end"]) / 2 for r in mine], [r["loss"] for r in mine],
                marker="o", label=f"windows of {format_length(length)}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("held-out loss by position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)
