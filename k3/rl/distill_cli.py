"""`k3 distill` (multi-teacher distillation) and `k3 distill demo`."""

from __future__ import annotations

import argparse
import json

import torch

from k3.cli_config import add_arguments, given

def _pairs(values: list[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag} takes NAME=PATH (the domain's name, then its path), got {value!r}")
        if name in out:
            raise ValueError(f"{flag} {name}=... given twice")
        out[name] = path
    return out


def distill_command(args: argparse.Namespace) -> int:
    from k3.rl.distill import DistillConfig, DistillTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.action == "demo":
        from k3.rl.distill_demo import run_distill_demo

        kwargs = {"distill_steps": args.steps} if args.steps else {}
        summary = run_distill_demo(out=args.out or "runs/distill-demo", json_path=args.json, **kwargs)
        return 0 if summary else 1
    if not args.out:
        raise ValueError("k3 distill needs --out DIR (the run directory)")
    if args.resume:
        config = DistillConfig(out=args.out)
    else:
        from k3.rl.distill_tasks import parse_rl_suite

        teachers, data = _pairs(args.teacher, "--teacher"), _pairs(args.data, "--data")
        suites = dict(parse_rl_suite(spec) for spec in args.rl_suite or [])
        if not args.student or not teachers or not (data or suites):
            raise ValueError("k3 distill needs --student DIR, at least one --teacher NAME=DIR and, per teacher, "
                             "--data NAME=PATH or --rl-suite NAME[:WEIGHT]")
        config = DistillConfig.flat(teachers=teachers, data=data, rl_suites=suites, **given(DistillConfig, args))
    overrides = {"steps": args.steps, "time_budget_s": args.time_budget_s} if args.resume else None
    trainer = DistillTrainer(config, resume=args.resume, resume_overrides=overrides)
    summary = trainer.train()
    if args.json:
        from k3.atomic import atomic_write_bytes

        atomic_write_bytes(args.json, (json.dumps(summary, indent=2) + "\n").encode())
    print(json.dumps(summary.get("last", {})))
    print(f"run written to {trainer.out} (checkpoint.pt, metrics.jsonl, metrics.png)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("distill", help="multi-teacher distillation into one student (k3 distill --student "
                                              "DIR --teacher NAME=DIR --data NAME=PATH --out DIR), or the CPU demo "
                                              "(k3 distill demo)")
    p.add_argument("action", nargs="?", default="train", choices=("train", "demo"))
    from k3.rl.distill_config import DistillConfig

    add_arguments(p, DistillConfig)  # every setting of the run, from its field's docstring (k3.rl.distill_config)
    p.add_argument("--teacher", action="append", help="NAME=DIR: the teacher of domain NAME (repeat per domain)")
    p.add_argument("--data", action="append", help="NAME=PATH: prompts of domain NAME (.jsonl with prompt/"
                                                   "completion or text, or text files); repeat per domain")
    p.add_argument("--rl-suite", action="append", dest="rl_suite",
                   help="NAME[:WEIGHT]: add WEIGHT (default 1) x the centred task reward of an RL suite (calc, "
                        "files, or a task file; single-turn, answer-checked) to the advantage; its prompts are "
                        "domain NAME, scored by --teacher NAME=DIR. Repeatable")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default 0: torch's choice)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    p.add_argument("--json", help="write the summary (demo: the per-domain table) to this file")
    p.set_defaults(func=distill_command)
