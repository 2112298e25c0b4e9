"""Worker for the sharded-checkpoint tests, launched by torchrun (gloo on CPU) or as one plain process.

    python -m torch.distributed.run --nproc-per-node N tests/distributed/sharded_worker.py --ep E \
        (--save DIR | --load DIR) --out FILE

--save: train the first half of the steps, save model and optimizer shards to DIR, train the second half.
--load: load DIR into this layout and train the second half. Rank 0 writes the second half's losses as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from k3.distributed import get_world_size, init_distributed, is_main, parallelize, shutdown, train_steps
from k3.distributed.sharded_checkpoint import load_sharded, save_sharded
from worker import build_model, global_batches  # the parity tests' model (debug preset, float64) and data

STEPS, BATCH, LENGTH, SEED = 4, 4, 16, 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_distributed(device="cpu")  # a plain process (no torchrun) stays single
    model = build_model(SEED)
    if get_world_size() > 1:
        model = parallelize(model, ep_size=args.ep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batches = global_batches(STEPS, BATCH, LENGTH, SEED)
    half = STEPS // 2
    local = get_world_size() == 1
    if args.save:
        train_steps(model, batches[:half], optimizer, local=local)
        save_sharded(args.save, model, optimizer, extra={"step": half})
        extra = {"step": half}
    else:
        extra = load_sharded(args.load, model, optimizer)
    losses = train_steps(model, batches[extra["step"]:], optimizer, local=local)
    if is_main():
        with open(args.out, "w") as handle:
            json.dump({"losses": losses, "extra": extra}, handle)
    shutdown()


if __name__ == "__main__":
    main()
