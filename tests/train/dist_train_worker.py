"""Runs k3's Trainer under torchrun (gloo on CPU) for the distributed resume test.

    python -m torch.distributed.run --nproc-per-node 2 tests/train/dist_train_worker.py OUT CORPUS EP [--stop-at N] [--resume]
        [--checkpoint-format full|sharded]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import _small_config  # noqa: E402  (the single-process tests' run settings)

from k3.distributed import shutdown  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("corpus")
    parser.add_argument("ep", type=int)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--checkpoint-format", default="full")
    args = parser.parse_args()
    config = _small_config(Path(args.out), Path(args.corpus), ep=args.ep, device="cpu",
                           checkpoint_format=args.checkpoint_format)
    trainer = Trainer(config, resume=args.resume, resume_overrides={"ep": args.ep, "device": "cpu"},
                      show_progress=False)
    trainer.train(stop_at=args.stop_at)
    shutdown()


if __name__ == "__main__":
    main()
