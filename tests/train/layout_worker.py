"""Runs one --global-batch Trainer under torchrun (gloo on CPU) for the layout-invariance test.

    python -m torch.distributed.run --nproc-per-node 2 tests/train/layout_worker.py OUT CORPUS EP [--stop-at N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import _small_config  # noqa: E402

from k3.distributed import shutdown  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402

# A full warm-up over the 10 steps keeps the updates small, so rounding differences between the layouts (packed
# shapes, reduction order; ~1e-7 at step 1) stay far below the 1e-5 the test allows.
LAYOUT_SETTINGS = dict(max_steps=10, batch_size=4, save_every=5, eval_every=5, warmup_steps=10, global_batch=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("corpus")
    parser.add_argument("ep", type=int)
    parser.add_argument("--stop-at", type=int)
    args = parser.parse_args()
    config = _small_config(Path(args.out), Path(args.corpus), ep=args.ep, device="cpu", **LAYOUT_SETTINGS)
    Trainer(config, show_progress=False).train(stop_at=args.stop_at)
    shutdown()


if __name__ == "__main__":
    main()
