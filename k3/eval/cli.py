"""`k3 eval`: long-context tasks at any length and loss by position, for a run or a Hugging Face model;
`k3 ablate`: matched runs that change one part of the architecture at a time, and their report.

    k3 eval --run runs/demo --task mqar needle_single --lengths 256,1K,4K --n 16 --json eval.json --plot eval.png
    k3 eval --run runs/demo --perplexity --lengths 1K,4K
    k3 eval --run runs/vqa --task vqa ocr --n 200 --json vqa.json      # a model with a vision tower
    k3 ablate --base debug --axis attention balancing --steps 400 --seeds 2 --out runs/ablate
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from k3.runtime import DTYPE_CHOICES, DTYPE_HELP


def _held_out_stream(args: argparse.Namespace, tokenizer) -> np.ndarray | None:
    """Token ids of held-out text: --data files, else the run's validation split, else None."""
    if args.data:
        from k3.data.corpus import load_corpus
        from k3.data.packing import tokenize_documents

        docs = load_corpus(args.data)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        return tokenize_documents([d.text for d in docs], tokenizer, eos, show_progress=False)
    if args.run:
        run_dir = Path(args.run)
        run_dir = run_dir.parent if run_dir.is_file() else run_dir
        val = run_dir / "data" / "val.bin"
        if val.is_file():
            from k3.data.packing import load_stream

            return load_stream(val)
    return None


def _mqar_layout(args: argparse.Namespace, vocab_size: int):
    """MQAR with the run's recall settings when it trained on recall rows (same key/value id ranges)."""
    from k3.data.synthetic import RecallTask

    pairs, queries = args.mqar_pairs, None
    if args.run:
        saved = Path(args.run) / "train_config.json"
        if saved.is_file() and pairs is None:
            from k3.train.config import TrainConfig

            trained = TrainConfig.from_dict(json.loads(saved.read_text()))  # sectioned, or an earlier flat layout
            pairs, queries = trained.recall.pairs, trained.recall.queries
    pairs = pairs or 8
    return RecallTask(vocab_size, num_pairs=pairs, num_queries=queries or pairs)


def _load_visual(args: argparse.Namespace):
    """(K3ForConditionalGeneration, tokenizer) for the visual tasks: a directory in the published multimodal
    layout (what `k3 vision demo` writes), or a run whose checkpoint holds a vision tower."""
    from k3.checkpoint.inference import load_for_inference
    from k3.infer.cli import has_vision
    from k3.runtime import inference_dtype

    directory = Path(args.model or args.run)
    if (args.run is None) == (args.model is None):
        raise ValueError("give exactly one of --run DIR or --model PATH")
    if directory.is_dir() and has_vision(directory):
        from k3.checkpoint.hf import load_hf_tokenizer
        from k3.checkpoint.hf_multimodal import from_pretrained
        from k3.train.trainer import resolve_device

        target = resolve_device(args.device)
        model = from_pretrained(directory, progress=False)
        model = model.to(target, inference_dtype(args.dtype, target)).requires_grad_(False).eval()
        return model, load_hf_tokenizer(directory)
    model, tokenizer = load_for_inference(args.run, args.model, args.device, args.dtype)
    if not hasattr(model, "vision"):
        raise ValueError(f"{directory} holds a text-only model; the visual tasks (vqa, ocr) need a vision tower "
                         f"(train one with `k3 vision demo --out DIR`)")
    return model, tokenizer


def eval_command(args: argparse.Namespace) -> int:
    from k3.eval.harness import evaluate_tasks
    from k3.eval.perplexity import perplexity_by_position
    from k3.eval.report import (accuracy_table, cost_table, parse_lengths, perplexity_table, plot_accuracy,
                                plot_perplexity, write_json)
    from k3.eval.tasks import TASKS, Filler, TaskContext
    from k3.checkpoint.inference import load_for_inference
    from k3.eval.visual import VISUAL_TASKS, evaluate_visual_tasks

    if args.n < 1:
        raise ValueError(f"--n must be >= 1 (examples per task and length), got {args.n}")
    if args.ppl_windows < 1:
        raise ValueError(f"--ppl-windows must be >= 1, got {args.ppl_windows}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = parse_lengths(args.lengths)
    tasks = list(TASKS) if not args.task or "all" in args.task else list(dict.fromkeys(args.task))
    if args.task and "all" in args.task:
        tasks += [t for t in args.task if t in VISUAL_TASKS]
    if args.perplexity_only:
        tasks = []
    visual_tasks = [t for t in tasks if t in VISUAL_TASKS]
    tasks = [t for t in tasks if t not in VISUAL_TASKS]
    if visual_tasks:
        visual_model, tokenizer = _load_visual(args)
        model = visual_model.language_model
    else:
        model, tokenizer = load_for_inference(args.run, args.model, args.device, args.dtype)
        model = getattr(model, "language_model", model)  # a run with a vision tower: its text tasks
    stream = _held_out_stream(args, tokenizer)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    json_path = args.json or (out / "eval.json" if out else None)
    plot_path = args.plot or (out / "eval.png" if out else None)

    if tasks or visual_tasks:
        results = []
        if tasks:
            mqar = _mqar_layout(args, model.config.vocab_size) if "mqar" in tasks else None
            ctx = TaskContext(tokenizer, model.config.vocab_size, Filler(tokenizer, stream), mqar)
            results += evaluate_tasks(model, tokenizer, ctx, tasks, lengths, args.n, args.seed, args.mode,
                                      show_progress=not args.quiet)
        if visual_tasks:
            results += evaluate_visual_tasks(visual_model, tokenizer, visual_tasks, args.n, args.seed,
                                             args.image_size)
        rows = [r.row() for r in results]
        print(accuracy_table(rows))
        print("\n" + cost_table(results))
        if json_path:  # with what each task cost: wall seconds and peak CUDA memory (None off CUDA)
            write_json(json_path, [{**r.row(), "seconds": r.seconds, "peak_gib": r.peak_gib} for r in results])
            print(f"rows written to {json_path}")
        if plot_path:
            plot_accuracy(rows, plot_path)
            print(f"plot written to {plot_path}")

    if args.perplexity or args.perplexity_only:
        if stream is None:
            raise ValueError("loss by position needs held-out text: give --run DIR with data/val.bin or --data "
                             "FILE (.txt, .jsonl, .parquet or a directory)")
        ppl_lengths = parse_lengths(args.ppl_lengths) if args.ppl_lengths else lengths
        start = time.perf_counter()
        buckets = perplexity_by_position(model, tokenizer, stream, ppl_lengths, args.ppl_windows, args.seed)
        ppl_rows = [b.row() for b in buckets]
        print("\n" + perplexity_table(ppl_rows))
        print(f"loss by position: {time.perf_counter() - start:.1f} s")
        ppl_json = args.ppl_json or (out / "perplexity.json" if out else None)
        if ppl_json:
            write_json(ppl_json, ppl_rows)
            print(f"perplexity rows written to {ppl_json}")
        if out:
            plot_perplexity(ppl_rows, out / "perplexity.png")
            print(f"plot written to {out / 'perplexity.png'}")
    return 0


def ablate_command(args: argparse.Namespace) -> int:
    from k3.eval.ablate import AXES, AblationSettings, report_ablation, run_ablation

    settings = AblationSettings(base=args.base, axes=tuple(args.axis or AXES), steps=args.steps, seeds=args.seeds,
                                seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                                recall_fraction=args.recall_fraction, recall_pairs=args.recall_pairs,
                                recall_queries=args.recall_queries, recall_length=args.recall_length,
                                recall_weight=args.recall_weight, max_corpus_mb=args.max_corpus_mb, data=tuple(args.data or ()),
                                eval_every=args.eval_every, threads=args.threads)
    if args.steps <= settings.warmup_steps:
        raise ValueError(f"--steps {args.steps} leaves no step after the {settings.warmup_steps} warm-up steps")
    if args.report_only:
        report_ablation(settings, args.out)
    else:
        run_ablation(settings, args.out, workers=args.workers)
    print(f"report written to {args.out}/report.md (plots: {args.out}/<axis>.png, rows: {args.out}/results.json)")
    return 0


def register(subparsers) -> None:
    from k3.eval.ablate import AXES
    from k3.eval.tasks import TASKS
    from k3.eval.visual import VISUAL_TASKS

    a = subparsers.add_parser("ablate", help="matched training runs, one architectural switch at a time, and a report")
    a.add_argument("--base", default="debug", help="base preset (default debug)")
    a.add_argument("--axis", nargs="+", choices=sorted(AXES), help="axes to ablate (default all)")
    a.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    a.add_argument("--seeds", type=int, default=2, help="seeds per arm (default 2)")
    a.add_argument("--seq-len", type=int, default=64, dest="seq_len")
    a.add_argument("--batch-size", type=int, default=16, dest="batch_size")
    a.add_argument("--lr", type=float, default=3e-3)
    a.add_argument("--recall-fraction", type=float, default=0.5, dest="recall_fraction")
    a.add_argument("--recall-pairs", type=int, default=4, dest="recall_pairs")
    a.add_argument("--recall-queries", type=int, default=0, dest="recall_queries",
                   help="queries per recall sequence (default: one per pair)")
    a.add_argument("--recall-length", type=int, default=0, dest="recall_length",
                   help="tokens per recall sequence, several packed into a row; MQAR is then measured at this length "
                        "and 4x it (default: one sequence per row, measured at --seq-len)")
    a.add_argument("--recall-weight", type=float, default=1.0, dest="recall_weight",
                   help="loss weight of a recall answer relative to a text token (default 1)")
    a.add_argument("--max-corpus-mb", type=float, default=1.0, dest="max_corpus_mb")
    a.add_argument("--data", action="append", help="training text (default: this machine's Python standard library)")
    a.add_argument("--eval-every", type=int, default=50, dest="eval_every")
    a.add_argument("--workers", type=int, default=1, help="runs at once, one process each (default 1)")
    a.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    a.add_argument("--out", required=True, help="ablation directory (results.json, report.md, plots, runs/)")
    a.add_argument("--report-only", action="store_true", dest="report_only",
                   help="write the report from the runs finished so far, run nothing")
    a.set_defaults(func=ablate_command)

    p = subparsers.add_parser("eval", help="long-context evaluation: MQAR, needles, variable tracking, common "
                                           "words at any length; loss by position")
    p.add_argument("--run", help="a k3 training run directory (or its checkpoint)")
    p.add_argument("--model", help="a Hugging Face-format model directory")
    p.add_argument("--task", nargs="+", choices=sorted(TASKS) + sorted(VISUAL_TASKS) + ["all"],
                   help="tasks (default all: the text tasks); vqa and ocr need a model with a vision tower")
    p.add_argument("--lengths", default="1K,4K", help="sequence lengths, e.g. 256,1K,4K,64K,1M (default 1K,4K)")
    p.add_argument("--n", type=int, default=16, help="examples per task and length (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, dest="image_size",
                   help="vqa / ocr: image side in px (default: the tower's position grid x patch, 112 for the demo)")
    p.add_argument("--mode", choices=["auto", "generate", "score"], default="auto",
                   help="auto: generate single final answers, score in-sequence answers (MQAR) by one prefill")
    p.add_argument("--mqar-pairs", type=int, dest="mqar_pairs",
                   help="MQAR key-value pairs (default: the run's --recall-pairs, else 8)")
    p.add_argument("--data", action="append", help="held-out text for filler and loss by position (default: the "
                                                   "run's validation split); repeatable")
    p.add_argument("--perplexity", action="store_true", help="also measure held-out loss by position")
    p.add_argument("--perplexity-only", action="store_true", dest="perplexity_only",
                   help="only the loss by position, no tasks")
    p.add_argument("--ppl-lengths", dest="ppl_lengths", help="window lengths for the loss (default --lengths)")
    p.add_argument("--ppl-windows", type=int, default=8, dest="ppl_windows", help="windows per length (default 8)")
    p.add_argument("--json", help="write the accuracy rows {task, length, accuracy, n} here")
    p.add_argument("--ppl-json", dest="ppl_json", help="write the loss-by-position rows here")
    p.add_argument("--plot", help="write the accuracy-by-length PNG here")
    p.add_argument("--out", help="directory for eval.json, eval.png, perplexity.json, perplexity.png")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=eval_command)
