"""`k3 train` and `k3 demo`."""

from __future__ import annotations

import argparse
import json

import torch

from k3.layers.balancing import QB_AGGREGATES
from k3.train.images import VISION_TRAIN
from k3.train.profile import PROFILE_AFTER, PROFILE_STEPS
from k3.train.schedule import parse_seq_len_schedule
from k3.train.trainer import TrainConfig, Trainer
from k3.vision.config import VISION_PRESETS


IMAGE_FLAGS = ("vision", "vision_train", "vision_lr", "image_fraction", "max_image_patches", "max_image_pixels",
               "max_image_bytes", "skip_bad_images", "allow_image_paths_outside")


def add_image_flags(parser: argparse.ArgumentParser, mixed: bool = True) -> None:
    """The flags of image-text data and the vision tower (k3 train; k3 sft without mixed, it has no text rows)."""
    group = parser.add_argument_group("image-text data (a --data .jsonl of {\"text\": \"... <image> ...\", "
                                      "\"images\": [...]} or {\"messages\": [...]} with image_url parts; "
                                      "docs/vision.md)")
    group.add_argument("--vision", choices=sorted(VISION_PRESETS),
                       help="vision preset of a new tower (k3 train: default k3 for --preset k3, else tiny; k3 sft: "
                            "only when the starting run has no tower, default tiny)")
    group.add_argument("--vision-train", choices=VISION_TRAIN, dest="vision_train",
                       help="all (default): tower and projector trained with the model; projector: tower frozen; "
                            "none: both frozen")
    group.add_argument("--vision-lr", type=float, dest="vision_lr",
                       help="peak learning rate of the vision tower and projector (default: --lr), on the same "
                            "warmup + cosine schedule")
    if mixed:
        group.add_argument("--image-fraction", type=float, dest="image_fraction",
                           help="share of each step's rows that are image-text rows, beside text rows (default "
                                "0.5); the text comes from the other --data files, or the default corpus")
    group.add_argument("--max-image-patches", type=int, dest="max_image_patches",
                       help="images are scaled down to at most this many 14-px patches (default 16384, as K2.5); "
                            "an example longer than a row (k3 train: --seq-len) with its images is an error")
    group.add_argument("--max-image-pixels", type=int, dest="max_image_pixels",
                       help="refuse an image with more pixels, before decoding it (decompression bombs; default "
                            "Pillow's MAX_IMAGE_PIXELS, 89,478,485)")
    group.add_argument("--max-image-bytes", type=int, dest="max_image_bytes",
                       help="refuse an image file or data: URL larger than this (default 32 MiB)")
    group.add_argument("--skip-bad-images", action="store_const", const=True, dest="skip_bad_images",
                       help="leave bad records out (missing or unreadable image, too large, placeholder count "
                            "mismatch) and print their count, instead of stopping at the first with its "
                            "file:line and field")
    group.add_argument("--allow-image-paths-outside", action="store_const", const=True,
                       dest="allow_image_paths_outside",
                       help="follow absolute image paths and paths outside the JSONL's folder (refused by default)")


def train_command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {}
    if args.resume:
        # Only what the user typed replaces the saved settings.
        for name in ("max_steps", "time_budget_s", "ep", "checkpoint_format", "ep_balanced", "qb_aggregate",
                     "log_every"):
            if getattr(args, name) is not None:
                overrides[name] = getattr(args, name)
        config = TrainConfig(out=args.out)
    else:
        fields = {name: getattr(args, name) for name in (
            "preset", "out", "max_steps", "seq_len", "batch_size", "lr", "warmup_steps", "weight_decay",
            "grad_clip", "dtype", "device", "seed", "max_corpus_mb", "tokenizer", "val_fraction", "eval_every",
            "eval_batches", "save_every", "recall_fraction", "recall_pairs", "recall_queries", "recall_length",
            "recall_weight", "time_budget_s", "ep", "checkpoint_format",
            "ep_balanced", "qb_aggregate", "qb_iters", "global_batch", "cuda_graph", "log_every",
            "master_weights", *IMAGE_FLAGS) if getattr(args, name) is not None}
        fields["data"] = list(args.data or [])
        if args.seq_len_schedule:
            fields["seq_len_schedule"] = parse_seq_len_schedule(args.seq_len_schedule)
        config = TrainConfig(**fields)
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
    kept = "checkpoint/" if trainer.config.checkpoint_format == "sharded" else "checkpoint.pt"
    print(f"run written to {trainer.out} ({kept}, metrics.jsonl, metrics.png)")
    return 0


def demo_command(args: argparse.Namespace) -> int:
    from k3.train.demo import run_demo

    run_demo(out=args.out, minutes=args.minutes, threads=args.threads, fresh=not args.keep)
    return 0


def register(subparsers) -> None:
    train = subparsers.add_parser("train", help="train a K3-architecture model (default data: this machine's "
                                                "Python standard library)")
    train.add_argument("--preset", help="model preset: debug, tiny, small, kimi-linear-48b, k3 (default tiny)")
    train.add_argument("--out", required=True, help="run directory")
    train.add_argument("--max-steps", type=int, dest="max_steps")
    train.add_argument("--data", action="append",
                       help=".txt, .jsonl (\"text\" field) or .parquet file, or a directory of them; repeatable. "
                            "A .jsonl of image-text records (\"images\" or \"messages\") trains the vision tower "
                            "too: see the image-text flags below")
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    train.add_argument("--tokenizer", help="a tokenizer.json, tiktoken model file or tokenizer directory "
                                           "(default: train a byte-level BPE on the corpus)")
    train.add_argument("--seq-len", type=int, dest="seq_len")
    train.add_argument("--seq-len-schedule", dest="seq_len_schedule",
                       help="length curriculum LENGTH:START_STEP,...: e.g. 256:0,1024:2000 trains 256-token rows, "
                            "then 1024-token rows once 2000 steps are done, at the first stage's tokens per step")
    train.add_argument("--batch-size", type=int, dest="batch_size", help="rows of --seq-len tokens per step")
    train.add_argument("--lr", type=float)
    train.add_argument("--warmup-steps", type=int, dest="warmup_steps")
    train.add_argument("--weight-decay", type=float, dest="weight_decay")
    train.add_argument("--grad-clip", type=float, dest="grad_clip")
    train.add_argument("--dtype", choices=["auto", "fp32", "bf16"],
                       help="auto: bf16 autocast on CUDA, fp32 on CPU")
    train.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    train.add_argument("--seed", type=int)
    train.add_argument("--max-corpus-mb", type=float, dest="max_corpus_mb", help="read at most this much text")
    train.add_argument("--val-fraction", type=float, dest="val_fraction")
    train.add_argument("--eval-every", type=int, dest="eval_every")
    train.add_argument("--eval-batches", type=int, dest="eval_batches")
    train.add_argument("--save-every", type=int, dest="save_every")
    train.add_argument("--recall-fraction", type=float, dest="recall_fraction",
                       help="share of rows replaced by synthetic associative-recall sequences")
    train.add_argument("--recall-pairs", type=int, dest="recall_pairs", help="key-value pairs per recall sequence")
    train.add_argument("--recall-queries", type=int, dest="recall_queries",
                       help="queries per recall sequence (default: one per pair)")
    train.add_argument("--recall-length", type=int, dest="recall_length",
                       help="tokens per recall sequence; several are packed into a row (default: one per row)")
    train.add_argument("--recall-weight", type=float, dest="recall_weight",
                       help="loss weight of a recall answer relative to a text token (default 1)")
    train.add_argument("--time-budget-s", type=float, dest="time_budget_s", help="stop (and save) after this long")
    train.add_argument("--threads", type=int, help="CPU threads for torch")
    train.add_argument("--ep", type=int, help="expert parallelism under `torchrun --nproc-per-node N -m k3 train "
                                             "... --ep P`: experts sharded over groups of P ranks (P divides N and "
                                             "the expert count; N/P groups replicate them), FSDP2 over all N")
    train.add_argument("--ep-balanced", action="store_const", const=True, dest="ep_balanced",
                       help="with --ep: balanced dispatch, every rank computes the same number of token-expert "
                            "pairs however skewed the routing (the hottest experts are replicated for the step)")
    train.add_argument("--qb-aggregate", choices=QB_AGGREGATES, dest="qb_aggregate",
                       help="under torchrun: how Quantile Balancing pools statistics over ranks; gather (default, "
                            "exact: [tokens, experts] from every rank per MoE layer) or histogram (published QB: one "
                            "all-reduce of E x 1000 counts per layer; --qb-iters: E x 256 per round; for many ranks "
                            "or experts)")
    train.add_argument("--global-batch", action="store_const", const=True, dest="global_batch",
                       help="under torchrun: --batch-size counts the rows of the whole step and every rank trains "
                            "its share of one stream, so 1 process and N ranks see the same batches and losses, and "
                            "a resume under another layout continues the same stream")
    train.add_argument("--qb-iters", type=int, dest="qb_iters",
                       help="Quantile Balancing, research option: iterate the update on the batch being routed "
                            "until every expert gets its quota, at most N updates per MoE layer and step (host syncs; "
                            "64 balances nearly every batch). Default 0: QB as published, one update per step from "
                            "the current batch, applied at the next step, no host sync")
    step = train.add_mutually_exclusive_group()
    step.add_argument("--cuda-graph", action="store_const", const=True, dest="cuda_graph",
                      help="replay each step's forward and backward from one CUDA graph (the default on a CUDA "
                           "device in one process): no host launch overhead, packed documents kept apart through "
                           "static shapes (a batch with more documents than the graph holds takes the eager step)")
    step.add_argument("--eager", action="store_const", const=False, dest="cuda_graph",
                      help="the eager step on CUDA too (for debugging: one kernel launch at a time, any batch)")
    train.add_argument("--master-weights", choices=["auto", "fp32-autocast", "bf16-params"], dest="master_weights",
                       help="bf16-params: the model's parameters in bf16 with fp32 masters in the optimizer (no "
                            "autocast casts); fp32-autocast: fp32 parameters under --dtype's autocast; auto (default): "
                            "bf16-params on CUDA in one process, fp32 on CPU. Checkpoints hold fp32 weights either way")
    train.add_argument("--log-every", type=int, dest="log_every", metavar="N",
                       help="read the step's metrics from the device every N steps in one sync (every step's values "
                            "are still written; step_seconds is the window's mean); default 10 on CUDA, 1 elsewhere")
    train.add_argument("--profile", metavar="DIR",
                       help=f"profile steps {PROFILE_AFTER + 1}-{PROFILE_AFTER + PROFILE_STEPS} of this run (after "
                            f"the first ones, which compile kernels) with torch.profiler and write "
                            f"DIR/profile_steps_A-B.txt: wall vs kernel vs host time per step, host syncs per step, "
                            f"the kernel and op tables")
    train.add_argument("--profile-at", type=int, metavar="STEP", dest="profile_at",
                       help=f"with --profile: the window's first step, counted from the run's start (default: "
                            f"{PROFILE_AFTER + 1} steps into this session); later steps show the step after the "
                            f"router has sharpened, when Quantile Balancing takes more updates")
    train.add_argument("--checkpoint-format", choices=["full", "sharded"], dest="checkpoint_format",
                       help="full (default): DIR/checkpoint.pt, gathered on rank 0; sharded: DIR/checkpoint/, "
                            "every rank writes its own shards (for models too large to gather); both resume under "
                            "any layout and load in `k3 generate`")
    add_image_flags(train)
    train.set_defaults(func=train_command)

    demo = subparsers.add_parser("demo", help="train the tiny preset on this machine's stdlib, sample from it and "
                                              "test long-range recall, within about 10 minutes on 2 CPU cores")
    demo.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    demo.add_argument("--minutes", type=float, default=10.0, help="total wall-clock budget (default 10)")
    demo.add_argument("--threads", type=int, default=0,
                      help="CPU threads (default: the idle cores, from the load average)")
    demo.add_argument("--keep", action="store_true", help="continue an existing demo run instead of starting over")
    demo.set_defaults(func=demo_command)
