"""Runs one --global-batch Trainer under torchrun (gloo on CPU) for the layout-invariance test.

    python -m torch.distributed.run --nproc-per-node 2 tests/train/layout_worker.py OUT CORPUS EP SETTINGS_JSON
        [--stop-at N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import _small_config  # noqa: E402

from k3.distributed import shutdown  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("corpus")
    parser.add_argument("ep", type=int)
    parser.add_argument("settings", help="TrainConfig fields as JSON (the test's LAYOUT_SETTINGS)")
    parser.add_argument("--stop-at", type=int)
    args = parser.parse_args()
    config = _small_config(Path(args.out), Path(args.corpus), ep=args.ep, device="cpu", **json.loads(args.settings))
    Trainer(config, show_progress=False).train(stop_at=args.stop_at)
    shutdown()


if __name__ == "__main__":
    main()
