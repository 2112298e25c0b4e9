"""`k3 rl` (train, demo, demos) and `k3 sft`."""

from __future__ import annotations

import argparse
import json

import torch

from k3.cli_config import add_arguments, given

# `k3 rl demo` flag -> run_rl_demo argument. Any other RL flag given to the demo is refused by name rather than
# silently ignored (a --heldout-tasks 400 that scored 200 tasks would mislead whoever reads the numbers).
DEMO_OPTIONS = {"algo": "algo", "steps": "rl_steps", "heldout_tasks": "heldout", "group": "group",
                "tasks_per_step": "tasks_per_step", "lr": "lr", "seed": "seed", "threads": "threads"}


def demo_options(args: argparse.Namespace) -> dict:
    """run_rl_demo's keyword arguments from the parsed flags; ValueError naming any flag the demo cannot honour."""
    from k3.rl.config import RLConfig

    typed = given(RLConfig, args)
    ignored = [("no_" if value is False else "") + name for name, value in typed.items()
               if name not in DEMO_OPTIONS and name != "out"]
    ignored += [name for name in ("no_tis", "resume") if getattr(args, name, False)]
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        allowed = ", ".join("--" + name.replace("_", "-") for name in DEMO_OPTIONS)
        raise ValueError(f"k3 rl demo does not take {flags}; it takes --out, --json, {allowed}")
    # None is a flag not given; 0 (e.g. --seed 0) is a value the user chose
    return {target: getattr(args, name) for name, target in DEMO_OPTIONS.items()
            if getattr(args, name, None) is not None}


def rl_command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.action == "demo":
        from k3.rl.demo import run_rl_demo

        run_rl_demo(out=args.out or "runs/rl-demo", json_path=args.json, **demo_options(args))
        return 0
    if args.action == "demos":
        from k3.rl.demos import write_demonstrations

        if not args.out:
            raise ValueError("k3 rl demos needs --out FILE.jsonl")
        suite = args.suite or "calc"
        from k3.rl.suites import SUITE_NAMES

        if suite not in SUITE_NAMES:
            raise ValueError(f"demonstrations come from a built-in suite's solver ({', '.join(SUITE_NAMES)}), "
                             f"not {suite!r}")
        summary = write_demonstrations(suite, args.count, args.out)
        print(json.dumps(summary))
        return 0
    from k3.rl.loop import RLConfig, RLTrainer

    if not args.out:
        raise ValueError("k3 rl needs --out DIR (the RL run directory)")
    if args.resume:
        config = RLConfig(out=args.out)
    else:
        if not args.run:
            raise ValueError("k3 rl needs --run DIR: the checkpoint to start from (a k3 train / k3 sft run)")
        fields = given(RLConfig, args)
        if args.no_tis:
            fields["tis_cap"] = None
        config = RLConfig.flat(**fields)
    overrides = {"steps": args.steps, "time_budget_s": args.time_budget_s} if args.resume else None
    trainer = RLTrainer(config, resume=args.resume, resume_overrides=overrides)
    main = trainer.ranks.main  # under torchrun, rank 0 speaks for the job
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if main:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}))
        print(f"run written to {trainer.out} (checkpoint.pt, metrics.jsonl, metrics.png)")
    return 0


def sft_command(args: argparse.Namespace) -> int:
    from k3.rl.sft import SFTConfig, SFTTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.resume and not (args.run and args.data):
        raise ValueError("k3 sft needs --run DIR (the starting checkpoint) and --data FILE.jsonl (demonstrations)")
    config = SFTConfig.flat(**given(SFTConfig, args))  # resumed: only --out and the overrides are read
    overrides = {"steps": args.steps, "time_budget_s": args.time_budget_s} if args.resume else None
    trainer = SFTTrainer(config, resume=args.resume, resume_overrides=overrides)
    summary = trainer.train()
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}))
    print(f"run written to {trainer.out} (checkpoint.pt, metrics.jsonl)")
    return 0


def register(subparsers) -> None:
    rl = subparsers.add_parser("rl", help="RL on sandboxed tool-use tasks (k3 rl --run DIR --suite calc --out "
                                          "DIR), the CPU demo (k3 rl demo), or solver demonstrations (k3 rl demos)")
    rl.add_argument("action", nargs="?", default="train", choices=("train", "demo", "demos"))
    from k3.rl.config import RLConfig

    add_arguments(rl, RLConfig)  # every setting of the run, from its field's docstring (k3.rl.config)
    rl.add_argument("--no-tis", action="store_true", dest="no_tis", help="no truncated importance sampling")
    rl.add_argument("--threads", type=int, default=0,
                    help="CPU threads for torch (default 0: torch's choice; the demo: the idle cores)")
    rl.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    rl.add_argument("--count", type=int, default=1000, help="demos: how many demonstrations")
    rl.add_argument("--json", help="demo: write the summary to this file")
    rl.set_defaults(func=rl_command)

    sft = subparsers.add_parser("sft", help="supervised fine-tuning on chat-formatted trajectories (assistant "
                                            "tokens only)")
    from k3.rl.sft import SFTConfig

    add_arguments(sft, SFTConfig)  # every setting of the run, from its field's docstring (k3.rl.sft)
    sft.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default 0: torch's choice)")
    sft.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    sft.set_defaults(func=sft_command)
