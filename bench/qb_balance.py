"""Quantile Balancing's three rules on CPU: the same `k3 train` run (tiny preset, the demo's 4 x 256-token batches
with recall rows, 16 experts, top-2) with the published rule (one update per step from the batch, applied at the
next step: --qb-iters 0, the default), one update on the routed batch itself (--qb-iters 1) and the update
iterated on the batch until it balances (--qb-iters 64). Prints and writes the maxvio of every routed training batch (max over MoE layers), its mean and
p99 after warm-up, the step time and the validation loss.

    python bench/qb_balance.py --steps 80 --out bench/results/qb_balance
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from k3.atomic import atomic_write_bytes
from k3.train.metrics import read_metrics
from k3.layers.balancing import QB_MAX_ITERS
from k3.train.trainer import TrainConfig, Trainer


def run_arm(out: Path, steps: int, qb_iters: int) -> dict:
    config = TrainConfig.flat(preset="tiny", out=str(out), max_steps=steps, seq_len=256, batch_size=4, lr=3e-3,
                              warmup_steps=10, max_corpus_mb=1.0, tokenizer_sample_mb=1.0, eval_every=steps,
                              save_every=steps, recall_fraction=0.25, qb_iters=qb_iters, seed=0)
    trainer = Trainer(config, show_progress=False, log=lambda *_: None)
    summary = trainer.train()
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "maxvio" in r]
    maxvio = [r["maxvio"] for r in rows]
    after_warmup = np.array(maxvio[config.optim.warmup_steps:])
    return {"qb_iters": qb_iters, "maxvio": maxvio,
            "maxvio_mean_after_warmup": float(after_warmup.mean()),
            "maxvio_p99_after_warmup": float(np.quantile(after_warmup, 0.99)),
            "tokens_per_s": summary["tokens_per_s"], "last_val_loss": summary["last_val_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--out", default="bench/results/qb_balance")
    parser.add_argument("--work", default="runs/bench_qb", help="run directories (deleted and rewritten)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import shutil

    arms = []
    for iters in (0, 1, QB_MAX_ITERS):
        work = Path(args.work) / f"iters{iters}"
        if work.exists():
            shutil.rmtree(work)
        arm = run_arm(work, args.steps, iters)
        arms.append(arm)
        print(f"qb_iters {iters:3d}: maxvio after warm-up mean {arm['maxvio_mean_after_warmup']:.4f} "
              f"p99 {arm['maxvio_p99_after_warmup']:.4f}; {arm['tokens_per_s']:.0f} tokens/s; "
              f"val loss {arm['last_val_loss']:.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out.with_suffix(".json"), (json.dumps({"steps": args.steps, "arms": arms}, indent=1)
                                                  + "\n").encode("utf-8"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm in arms:
        label = {0: "published (one update, applied at the next step)",
                 1: "one update on the routed batch"}.get(arm["qb_iters"], f"iterated on the batch (<= {arm['qb_iters']})")
        ax.plot(range(1, len(arm["maxvio"]) + 1), arm["maxvio"], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("maxvio of the routed batch (max over layers)")
    ax.set_yscale("symlog", linthresh=0.05)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
