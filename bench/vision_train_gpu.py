"""Image-text training on one GPU through `k3 train`: images of four sizes packed into every step (one tower call
over the pack's cu_seqlens, the flash varlen path under bf16 autocast; no padding to the largest image), the
K3 vision tower trained with the language model, and `--profile`'s split of the step between them.

    python bench/vision_train_gpu.py --out DIR                  # one H100 / H200, about 3 minutes
    python bench/vision_train_gpu.py --out DIR --cpu-check      # the script's logic on the CPU at toy shapes

DIR/results.json: images/s and tokens/s in training (the steps after the first --skip, which compile kernels),
the step's TFLOP/s and MFU against 989 TFLOP/s (dense bf16, H100 / H200 SXM), the profile's split (vision tower +
projector forward and backward, language model, the rest), the pack's image sizes and images per step. DIR/run
holds the k3 train run (metrics.jsonl), DIR/profile the profile report, DIR/data the generated images.

The step's FLOPs: 6 x (the language model's active parameters without the embedding x tokens + the tower's
parameters x patches + the projector's x merged tokens) + the tower's attention, 12 x layers x QKV width x the
sum over images of patches^2 (forward and backward). The language model's attention is left out (documents of
16-260 tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3.vision.demo import GPU_BF16_PEAK_FLOPS  # noqa: E402
from k3.vision.synthetic_qa import SyntheticVQA  # noqa: E402


def write_data(folder: Path, sizes: list[int], per_size: int) -> Path:
    """per_size synthetic VQA pictures of each size as one image-text JSONL (paths inside the folder), and the
    synthetic set's word tokenizer in folder/tokenizer."""
    lines = []
    for size in sizes:
        qa = SyntheticVQA(size=size, seed=size)
        jsonl = qa.write_jsonl(folder / f"s{size}", per_size)
        for line in jsonl.read_text().splitlines():
            record = json.loads(line)
            lines.append(json.dumps({"text": record["text"], "images": [f"s{size}/{record['images'][0]}"]}))
    qa.tokenizer().save(folder / "tokenizer")
    path = folder / "mm.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def step_flops(trainer, record: dict) -> float:
    """Training FLOPs of one step from its metrics record (see the module docstring)."""
    from k3.model import count_parameters

    vision = trainer.images.vision
    config = vision.config
    active = count_parameters(trainer.model.config)["active_params"]
    tower = sum(p.numel() for p in vision.vision_tower.parameters())
    projector = sum(p.numel() for p in vision.mm_projector.parameters())
    patches = record["image_patches"]
    merged = patches / (config.merge_kernel[0] * config.merge_kernel[1])
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * record["patches_squared"]
    return 6.0 * (active * record["tokens"] + tower * patches + projector * merged) + attention


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-check", action="store_true", help="toy shapes on the CPU (checks the script only)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the rates")
    parser.add_argument("--time-budget", type=float, default=150.0, help="seconds of training at most")
    parser.add_argument("--rows", type=int, default=1, help="rows of 4,096 tokens a step (GPU; ~30 images a row)")
    args = parser.parse_args(argv)

    from k3.train.profile import PROFILE_STEPS
    from k3.train.trainer import TrainConfig, Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_check:
        sizes, per_size, preset, vision, seq_len, rows, steps = [56, 84, 112], 8, "debug", "tiny", 256, 2, 10
        skip, device = 2, "cpu"
    else:
        # 112-448 px: 8x8 to 32x32 patches, 16 to 256 image tokens; ~30 images and ~14k patches a row. Beside
        # ~36 GB of fp32 weights, gradients and AdamW states, 2 rows ran out of an H100's 80 GB at the second step
        sizes, per_size, preset, vision, seq_len, rows, steps = [112, 224, 336, 448], 64, "small", "k3", 4096, \
            args.rows, args.steps
        skip, device = args.skip, "cuda"
    started = time.perf_counter()
    data = write_data(out / "data", sizes, per_size)
    build = getattr(TrainConfig, "flat", TrainConfig)  # by the flags' flat field names, sectioned config or not
    config = build(preset=preset, out=str(out / "run"), data=[str(data)], tokenizer=str(out / "data" / "tokenizer"),
                   image_fraction=1.0, vision=vision, seq_len=seq_len, batch_size=rows, max_steps=steps, lr=3e-4,
                   warmup_steps=5, eval_every=10**6, save_every=10**6, val_fraction=0.02, max_corpus_mb=1.0,
                   recall_fraction=0.0, device=device, time_budget_s=args.time_budget)
    trainer = Trainer(config, show_progress=False, profile=out / "profile", profile_at=skip + 1)
    if device == "cuda":
        trainer.images.vision.attention_backend = "varlen"  # one flash call over the pack (an error if it cannot)
    patches_squared = {}  # step -> sum over the step's images of patches^2, recorded as batches are drawn
    draw = trainer._next_batch

    def counting_draw():
        batch, tokens = draw()
        patches_squared[trainer.step + 1] = int((batch.grid_thw.prod(-1) ** 2).sum())
        return batch, tokens

    trainer._next_batch = counting_draw
    summary = trainer.train()
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    # timed: after the first steps (kernel compiles) and the profiled ones (the profiler's overhead)
    steps_run = [r for r in records if "loss" in r and "images" in r and r["step"] > skip + PROFILE_STEPS]
    for r in steps_run:
        r["patches_squared"] = patches_squared[r["step"]]
    seconds = sum(r["step_seconds"] for r in steps_run)
    flops = sum(step_flops(trainer, r) for r in steps_run)
    profile = json.loads(Path(summary["profile"]).with_suffix(".json").read_text()) if summary.get("profile") else None
    tower = trainer.images.vision
    results = {
        "device": __import__("torch").cuda.get_device_name() if device == "cuda" else "cpu",
        "preset": preset, "vision": vision, "image_sizes_px": sizes, "seq_len": seq_len, "rows": rows,
        "attention_backend": tower.attention_backend,
        "steps_run": summary["steps"], "steps_timed": len(steps_run),
        "images_per_step": sum(r["images"] for r in steps_run) / max(1, len(steps_run)),
        "patches_per_step": sum(r["image_patches"] for r in steps_run) / max(1, len(steps_run)),
        "train_images_per_second": sum(r["images"] for r in steps_run) / seconds if seconds else None,
        "train_tokens_per_second": sum(r["tokens"] for r in steps_run) / seconds if seconds else None,
        "step_ms": 1e3 * seconds / max(1, len(steps_run)),
        "train_tflops": flops / seconds / 1e12 if seconds else None,
        "mfu": flops / seconds / GPU_BF16_PEAK_FLOPS if seconds and device == "cuda" else None,
        "first_step_s": summary.get("first_step_s"),
        "profile": profile,
        "last_loss": steps_run[-1]["loss"] if steps_run else None,
        "wall_seconds": time.perf_counter() - started,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
