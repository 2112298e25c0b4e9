"""`k3 train` and `k3 demo`."""

from __future__ import annotations

import argparse
import json

import torch

from k3.cli_config import add_arguments, given
from k3.train.config import TrainConfig
from k3.train.profile import PROFILE_AFTER, PROFILE_STEPS
from k3.train.trainer import Trainer


# Settings a resumed run takes from the command line; the rest come from the run (its data, model and optimizer).
RESUME_OVERRIDES = ("max_steps", "time_budget_s", "ep", "checkpoint_format", "ep_balanced", "qb_aggregate",
                    "log_every")


def train_command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    typed = given(TrainConfig, args)
    overrides = {}
    if args.resume:
        # Only what the user typed replaces the saved settings.
        overrides = {name: value for name, value in typed.items() if name in RESUME_OVERRIDES}
        config = TrainConfig(out=args.out)
    else:
        config = TrainConfig.flat(**typed)
    if args.profile_at is not None and args.profile is None:
        raise SystemExit(f"--profile-at {args.profile_at} sets where the --profile window starts; add --profile DIR")
    trainer = Trainer(config, resume=args.resume, resume_overrides=overrides, profile=args.profile,
                      profile_at=args.profile_at)
    summary = trainer.train()
    if trainer.dist is not None:
        from k3.distributed import shutdown
        shutdown()
        if trainer.dist.rank != 0:
            return 0
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}))
    kept = "checkpoint/" if trainer.config.checkpoint.format == "sharded" else "checkpoint.pt"
    print(f"run written to {trainer.out} ({kept}, metrics.jsonl, metrics.png)")
    return 0


def demo_command(args: argparse.Namespace) -> int:
    from k3.train.demo import run_demo

    run_demo(out=args.out, minutes=args.minutes, threads=args.threads, fresh=not args.keep)
    return 0


def register(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a K3-architecture model (default data: this machine's "
                                                "Python standard library)")
    add_arguments(train, TrainConfig)  # every setting of the run, from its field's docstring (k3.train.config)
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    train.add_argument("--threads", type=int, help="CPU threads for torch")
    train.add_argument("--profile", metavar="DIR",
                       help=f"profile steps {PROFILE_AFTER + 1}-{PROFILE_AFTER + PROFILE_STEPS} of this run (after "
                            f"the first ones, which compile kernels) with torch.profiler and write "
                            f"DIR/profile_steps_A-B.txt: wall vs kernel vs host time per step, host syncs per step, "
                            f"the kernel and op tables")
    train.add_argument("--profile-at", type=int, metavar="STEP", dest="profile_at",
                       help=f"with --profile: the window's first step, counted from the run's start (default: "
                            f"{PROFILE_AFTER + 1} steps into this session); later steps show the step after the "
                            f"router has sharpened, when Quantile Balancing takes more updates")
    train.set_defaults(func=train_command)

    demo = subparsers.add_parser("demo", help="train the tiny preset on this machine's stdlib, sample from it and "
                                              "test long-range recall, within about 10 minutes on 2 CPU cores")
    demo.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    demo.add_argument("--minutes", type=float, default=10.0, help="total wall-clock budget (default 10)")
    demo.add_argument("--threads", type=int, default=0,
                      help="CPU threads (default: the idle cores, from the load average)")
    demo.add_argument("--keep", action="store_true", help="continue an existing demo run instead of starting over")
    demo.set_defaults(func=demo_command)
