"""`k3 vision demo`: train a tiny vision-language model on generated pictures and report held-out accuracy per
question kind (colour, shape, count, position, text), before and after, against chance.

    k3 vision demo --out runs/vqa                      # CPU, about 9 CPU-minutes
    k3 vision demo --out runs/vqa --json               # the report as JSON on stdout
    k3 eval --run runs/vqa --task vqa ocr --n 200      # the saved model through the engine
"""

from __future__ import annotations

import argparse
import json
import sys


def demo_command(args: argparse.Namespace) -> int:
    from k3.vision.demo import DemoSettings, run_demo, summary_table

    settings = DemoSettings(image_size=args.image_size, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                            vision_lr=args.vision_lr, seed=args.seed, eval_count=args.eval_count,
                            eval_every=args.eval_every, kinds=tuple(args.kinds), vision_width=args.vision_width,
                            vision_layers=args.vision_layers, vision_heads=args.vision_heads,
                            vision_head_dim=args.vision_head_dim, text_preset=args.text_preset,
                            text_layers=args.text_layers or None, loss_per=args.loss_per, device=args.device,
                            dtype=args.dtype, threads=args.threads)
    human = sys.stderr if args.json else sys.stdout
    report = run_demo(settings, out=args.out, progress=not (args.quiet or args.json),
                      log=lambda line: print(line, file=human, flush=True))
    if args.json:
        print(json.dumps(report))
        return 0
    print(summary_table(report))
    print(f"cpu {report['cpu_seconds'] / 60:.1f} min, wall {report['wall_seconds'] / 60:.1f} min, training "
          f"{report['train_images_per_second']:.0f} img/s"
          + (f", {report['train_tflops']:.2f} TFLOP/s = MFU {report['mfu']:.2%}" if "mfu" in report else ""))
    if args.out:
        print(f"model, report.json and curve.png written to {args.out}; evaluate it through the engine with "
              f"`k3 eval --run {args.out} --task vqa ocr`")
    return 0


def register(subparsers) -> None:
    from k3.vision.synthetic_qa import KINDS

    vision = subparsers.add_parser("vision", help="vision-language demo: a tiny model learns visual QA on generated "
                                                  "pictures")
    commands = vision.add_subparsers(dest="vision_command", metavar="COMMAND", required=True)
    p = commands.add_parser("demo", help="train on synthetic visual QA; held-out accuracy per question kind")
    p.add_argument("--out", help="directory for the model (published K3 layout), report.json and curve.png")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32, dest="batch_size")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warm-up 10%%, cosine to 1%%)")
    p.add_argument("--vision-lr", type=float, dest="vision_lr", help="tower + projector (default --lr)")
    p.add_argument("--image-size", type=int, default=84, dest="image_size", help="px, a multiple of 28")
    p.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="question kinds")
    p.add_argument("--vision-width", type=int, default=96, dest="vision_width")
    p.add_argument("--vision-layers", type=int, default=3, dest="vision_layers")
    p.add_argument("--vision-heads", type=int, default=4, dest="vision_heads")
    p.add_argument("--vision-head-dim", type=int, default=32, dest="vision_head_dim")
    p.add_argument("--text-preset", default="debug", dest="text_preset", help="language model preset (default debug)")
    p.add_argument("--text-layers", type=int, default=4, dest="text_layers",
                   help="language model layers, KDA and MLA alternating (default 4; 0: the preset's own)")
    p.add_argument("--loss-per", choices=["sample", "token"], default="sample", dest="loss_per",
                   help="average the answer loss per question (default) or per token")
    p.add_argument("--eval-count", type=int, default=500, dest="eval_count", help="held-out samples")
    p.add_argument("--eval-every", type=int, default=100, dest="eval_every", help="steps between curve points")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast on CUDA")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--json", action="store_true", help="print the report as JSON (progress off)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=demo_command)
