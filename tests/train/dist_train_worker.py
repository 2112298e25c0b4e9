"""Runs k3's Trainer under torchrun (gloo on CPU) for the distributed resume test.

    python -m torch.distributed.run --nproc-per-node 2 tests/train/dist_train_worker.py OUT CORPUS EP [--stop-at N] [--resume]
        [--checkpoint-format full|sharded] [--ep-balanced] [--qb-aggregate gather|histogram]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import _small_config  # noqa: E402  (the single-process tests' run settings)

from k3.distributed import is_main, shutdown  # noqa: E402
from k3.distributed.parallelize import ExpertParallelMoE, dispatch_stats  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("corpus")
    parser.add_argument("ep", type=int)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--checkpoint-format", default="full")
    parser.add_argument("--ep-balanced", action="store_true")
    parser.add_argument("--qb-aggregate", default="gather")
    args = parser.parse_args()
    config = _small_config(Path(args.out), Path(args.corpus), ep=args.ep, device="cpu",
                           checkpoint_format=args.checkpoint_format, ep_balanced=args.ep_balanced,
                           qb_aggregate=args.qb_aggregate)
    trainer = Trainer(config, resume=args.resume, resume_overrides={"ep": args.ep, "device": "cpu"},
                      show_progress=False)
    trainer.train(stop_at=args.stop_at)
    # What the options switched on, per MoE layer, for the test to check against the flags.
    moes = [m for m in trainer.model.modules() if isinstance(m, ExpertParallelMoE)]
    wiring = {"balanced": [m.balanced for m in moes],
              "histogram": [router.reduce is not None for _, router in trainer.model.routers()],
              "pairs_per_rank": [list(s.pairs_per_rank) for s in dispatch_stats(trainer.model)]}
    if is_main():
        (Path(args.out) / "wiring.json").write_text(json.dumps(wiring))
    shutdown()


if __name__ == "__main__":
    main()
