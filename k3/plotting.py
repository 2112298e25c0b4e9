"""Plot helpers shared by the reports that draw PNGs (eval, the vision demo): matplotlib without a display, and a
figure written atomically.

    plt = pyplot()
    fig, ax = plt.subplots()
    ...
    save_png(fig, "curve.png")
"""

from __future__ import annotations

import io
from pathlib import Path

from k3.atomic import atomic_write_bytes


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed; imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path, dpi: int = 110) -> None:
    """Lay out, write the figure as PNG atomically (a reader never sees half a file) and close it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(Path(path), buffer.getvalue())
