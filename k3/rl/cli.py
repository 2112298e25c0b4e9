"""`k3 rl` (train, demo, demos) and `k3 sft`."""

from __future__ import annotations

import argparse
import json

import torch

from k3.rl.losses import ALGORITHMS
from k3.runtime import DTYPE_CHOICES

RL_FIELDS = ("run", "suite", "out", "algo", "group", "tasks_per_step", "steps", "lr", "minibatches", "temperature",
             "heldout_every", "heldout_tasks", "save_every", "seed", "kl_coef", "tis_cap", "clip_low", "clip_high",
             "tau", "max_context", "tool_budget", "iteration_token_budget", "device", "ray", "rollout_workers",
             "rollout_worker_cpus", "rollout_worker_gpus", "routing_source", "rollout_dtype", "heldout_samples",
             "refill_rounds", "sandbox_backend")


# `k3 rl demo` flag -> run_rl_demo argument. Any other RL flag given to the demo is refused by name rather than
# silently ignored (a --heldout-tasks 400 that scored 200 tasks would mislead whoever reads the numbers).
DEMO_OPTIONS = {"algo": "algo", "steps": "rl_steps", "heldout_tasks": "heldout", "group": "group",
                "tasks_per_step": "tasks_per_step", "lr": "lr", "seed": "seed", "threads": "threads"}


def demo_options(args: argparse.Namespace) -> dict:
    """run_rl_demo's keyword arguments from the parsed flags; ValueError naming any flag the demo cannot honour."""
    ignored = [name for name in RL_FIELDS if name not in DEMO_OPTIONS and name != "out"
               and getattr(args, name, None) is not None]
    ignored += [name for name in ("no_tis", "no_routing_replay", "resume") if getattr(args, name, False)]
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
        fields = {name: getattr(args, name) for name in RL_FIELDS if getattr(args, name, None) is not None}
        if args.no_routing_replay:
            fields["routing_replay"] = False
        if args.no_tis:
            fields["tis_cap"] = None
        config = RLConfig(**fields)
    trainer = RLTrainer(config, resume=args.resume, steps_override=args.steps if args.resume else None)
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
    from k3.train.cli import IMAGE_FLAGS

    fields = {name: getattr(args, name) for name in ("run", "data", "out", "steps", "batch_size", "lr", "seed",
                                                     "device", "save_every", *IMAGE_FLAGS)
              if getattr(args, name, None) is not None}
    if not args.resume and not (args.run and args.data):
        raise ValueError("k3 sft needs --run DIR (the starting checkpoint) and --data FILE.jsonl (demonstrations)")
    trainer = SFTTrainer(SFTConfig(**fields), resume=args.resume, steps_override=args.steps)
    summary = trainer.train()
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}))
    print(f"run written to {trainer.out} (checkpoint.pt, metrics.jsonl)")
    return 0


def register(subparsers) -> None:
    rl = subparsers.add_parser("rl", help="RL on sandboxed tool-use tasks (k3 rl --run DIR --suite calc --out "
                                          "DIR), the CPU demo (k3 rl demo), or solver demonstrations (k3 rl demos)")
    rl.add_argument("action", nargs="?", default="train", choices=("train", "demo", "demos"))
    rl.add_argument("--run", "--from", dest="run",
                    help="starting checkpoint: a k3 train / k3 sft / k3 rl run directory (--from: the same, for "
                         "torchrun, whose own --run-path makes it refuse --run)")
    rl.add_argument("--suite", default=None, help="calc, arith, fix, files, browse, or a .jsonl file / directory of tasks")
    rl.add_argument("--out", help="the RL run directory (demos: the JSONL file to write)")
    rl.add_argument("--algo", choices=sorted(ALGORITHMS), help="policy objective (default gspo)")
    rl.add_argument("--group", type=int, help="episodes per task, forked from one snapshot (default 8)")
    rl.add_argument("--tasks-per-step", type=int, dest="tasks_per_step")
    rl.add_argument("--steps", type=int, help="steps in all (with --resume: extend the run to this many)")
    rl.add_argument("--lr", type=float)
    rl.add_argument("--minibatches", type=int, help="optimizer steps per batch of rollouts")
    rl.add_argument("--temperature", type=float)
    rl.add_argument("--heldout-every", type=int, dest="heldout_every")
    rl.add_argument("--heldout-tasks", type=int, dest="heldout_tasks")
    rl.add_argument("--heldout-samples", type=int, dest="heldout_samples",
                    help="held-out episodes per task at the rollout temperature, for sampled pass@1 and pass@k "
                         "(default: the group size; 0: greedy only)")
    rl.add_argument("--refill-rounds", type=int, dest="refill_rounds",
                    help="dynamic sampling: extra rounds of fresh tasks that refill a batch whose all-equal groups "
                         "were dropped (default 3; 0: no refill)")
    rl.add_argument("--save-every", type=int, dest="save_every")
    rl.add_argument("--seed", type=int)
    rl.add_argument("--kl-coef", type=float, dest="kl_coef", help="KL to the frozen starting policy (default 0)")
    rl.add_argument("--tis-cap", type=float, dest="tis_cap", help="truncated importance sampling cap (default 2)")
    rl.add_argument("--no-tis", action="store_true", dest="no_tis", help="no truncated importance sampling")
    rl.add_argument("--clip-low", type=float, dest="clip_low")
    rl.add_argument("--clip-high", type=float, dest="clip_high")
    rl.add_argument("--tau", type=float, help="pmd: the KL strength")
    rl.add_argument("--max-context", type=int, dest="max_context")
    rl.add_argument("--tool-budget", type=int, dest="tool_budget", help="characters of one tool observation")
    rl.add_argument("--iteration-token-budget", type=int, dest="iteration_token_budget",
                    help="partial rollouts: park episodes once a step has generated this many tokens")
    rl.add_argument("--no-routing-replay", action="store_true", dest="no_routing_replay")
    rl.add_argument("--routing-source", choices=("rollout", "trainer"), dest="routing_source",
                    help="routing replay of the engine's recorded experts (default) or of the trainer's old pass")
    rl.add_argument("--rollout-dtype", choices=DTYPE_CHOICES, dest="rollout_dtype",
                    help="the in-process engine's weights: auto = a bf16 copy of the policy on CUDA, refreshed after "
                         "each update (fp32: the policy itself, the default on CPU)")
    rl.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                    help="rollouts on Ray workers: a local Ray (no ADDRESS) or the cluster at ADDRESS")
    rl.add_argument("--rollout-workers", type=int, dest="rollout_workers", help="--ray: rollout workers (default 2)")
    rl.add_argument("--rollout-worker-cpus", type=float, dest="rollout_worker_cpus")
    rl.add_argument("--rollout-worker-gpus", type=float, dest="rollout_worker_gpus")
    rl.add_argument("--sandbox-backend", choices=("local", "vm"), dest="sandbox_backend",
                    help="episode sandboxes: local (namespaces, the default) or vm (microVMs; needs KVM, see "
                         "docs/sandbox.md)")
    rl.add_argument("--device")
    rl.add_argument("--threads", type=int, default=0)
    rl.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    rl.add_argument("--count", type=int, default=1000, help="demos: how many demonstrations")
    rl.add_argument("--json", help="demo: write the summary to this file")
    rl.set_defaults(func=rl_command)

    sft = subparsers.add_parser("sft", help="supervised fine-tuning on chat-formatted trajectories (assistant "
                                            "tokens only)")
    sft.add_argument("--run", help="starting checkpoint (a k3 train run directory)")
    sft.add_argument("--data", help="demonstrations JSONL ({\"messages\": [...]} per line; k3 rl demos writes one); "
                                    "content may hold image_url parts (docs/vision.md): the vision tower is then "
                                    "trained too")
    sft.add_argument("--out", required=True)
    sft.add_argument("--steps", type=int)
    sft.add_argument("--batch-size", type=int, dest="batch_size")
    sft.add_argument("--lr", type=float)
    sft.add_argument("--seed", type=int)
    sft.add_argument("--save-every", type=int, dest="save_every")
    sft.add_argument("--device")
    sft.add_argument("--threads", type=int, default=0)
    sft.add_argument("--resume", action="store_true")
    from k3.train.cli import add_image_flags
    add_image_flags(sft, mixed=False)
    sft.set_defaults(func=sft_command)
