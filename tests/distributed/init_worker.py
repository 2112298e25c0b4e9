"""Worker for tests/distributed/test_init.py, launched by torchrun (gloo on CPU):

    python -m torch.distributed.run --nproc-per-node N tests/distributed/init_worker.py EP[,EP...] SEED OUT_DIR

builds the debug preset with build_parallel_model for each EP size in turn and saves its full state dict from
rank 0 to OUT_DIR/state_ep{EP}.pt (one launch for several layouts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from k3.config import ModelConfig
from k3.distributed import full_state_dict, init_distributed, is_main, shutdown
from k3.distributed.init import build_parallel_model


def main() -> None:
    eps, seed, out_dir = [int(ep) for ep in sys.argv[1].split(",")], int(sys.argv[2]), Path(sys.argv[3])
    env = init_distributed(device="cpu")
    for ep in eps:
        model = build_parallel_model(ModelConfig.from_preset("debug"), env.device, ep_size=ep, seed=seed)
        local_bytes = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        state = full_state_dict(model)
        if is_main():
            torch.save({"state": state, "local_numel_rank0": local_bytes}, out_dir / f"state_ep{ep}.pt")
    shutdown()


if __name__ == "__main__":
    main()
