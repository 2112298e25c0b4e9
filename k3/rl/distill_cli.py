"""`k3 distill` (multi-teacher distillation) and `k3 distill demo`."""

from __future__ import annotations

import argparse
import json

import torch

from k3.rl.distill import ESTIMATORS, MODES, TOKEN_LEVEL_ALGORITHMS

FIELDS = ("student", "out", "mode", "estimator", "algo", "steps", "prompts_per_domain", "samples", "prompt_tokens",
          "reference_tokens", "max_new_tokens", "temperature", "lr", "lr_schedule", "top_k", "mixed_weight", "tis_cap", "baseline", "suite_tasks",
          "heldout_prompts", "heldout_samples", "heldout_every", "save_every", "seed", "max_context", "device")


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
        fields = {name: getattr(args, name) for name in FIELDS if getattr(args, name, None) is not None}
        config = DistillConfig(teachers=teachers, data=data, rl_suites=suites, **fields)
    trainer = DistillTrainer(config, resume=args.resume)
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
    p.add_argument("--student", help="the student: a k3 run or a Hugging Face-format directory")
    p.add_argument("--teacher", action="append", help="NAME=DIR: the teacher of domain NAME (repeat per domain)")
    p.add_argument("--data", action="append", help="NAME=PATH: prompts of domain NAME (.jsonl with prompt/"
                                                   "completion or text, or text files); repeat per domain")
    p.add_argument("--out", help="the run directory")
    p.add_argument("--mode", choices=MODES, help="on-policy (default), offline (SFT on teacher samples), "
                                                 "forward-kl (teacher top-k), mixed (on-policy + top-k forward KL)")
    p.add_argument("--estimator", choices=ESTIMATORS,
                   help="on-policy reverse KL: sampled (default: per-token advantage log p_teacher - log p_student "
                        "through the policy-gradient step) or topk (the reverse KL over the teacher's top-k ids "
                        "plus one bucket for the rest, at the student's own sampled positions)")
    p.add_argument("--baseline", action="store_true", default=None,
                   help="sampled estimator: subtract the batch's mean advantage (a constant baseline)")
    p.add_argument("--rl-suite", action="append", dest="rl_suite",
                   help="NAME[:WEIGHT]: add WEIGHT (default 1) x the centred task reward of an RL suite (calc, "
                        "files, or a task file; single-turn, answer-checked) to the advantage; its prompts are "
                        "domain NAME, scored by --teacher NAME=DIR. Repeatable")
    p.add_argument("--suite-tasks", type=int, dest="suite_tasks", help="training tasks per built-in suite")
    p.add_argument("--algo", choices=TOKEN_LEVEL_ALGORITHMS, help="policy-gradient objective (default dapo)")
    p.add_argument("--steps", type=int)
    p.add_argument("--prompts-per-domain", type=int, dest="prompts_per_domain")
    p.add_argument("--samples", type=int, help="completions per prompt")
    p.add_argument("--prompt-tokens", type=int, dest="prompt_tokens")
    p.add_argument("--reference-tokens", type=int, dest="reference_tokens")
    p.add_argument("--max-new-tokens", type=int, dest="max_new_tokens")
    p.add_argument("--temperature", type=float)
    p.add_argument("--lr", type=float)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), dest="lr_schedule",
                   help="constant (default) or cosine down to lr/10 at the last step")
    p.add_argument("--top-k", type=int, dest="top_k")
    p.add_argument("--mixed-weight", type=float, dest="mixed_weight")
    p.add_argument("--tis-cap", type=float, dest="tis_cap")
    p.add_argument("--heldout-prompts", type=int, dest="heldout_prompts")
    p.add_argument("--heldout-samples", type=int, dest="heldout_samples")
    p.add_argument("--heldout-every", type=int, dest="heldout_every")
    p.add_argument("--save-every", type=int, dest="save_every")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-context", type=int, dest="max_context")
    p.add_argument("--device")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    p.add_argument("--json", help="write the summary (demo: the per-domain table) to this file")
    p.set_defaults(func=distill_command)
