"""Worker for tests/distributed/test_init.py, launched by torchrun (gloo on CPU):

    python -m torch.distributed.run --nproc-per-node N tests/distributed/init_worker.py EP SEED OUT

builds the debug preset with build_parallel_model and saves its full state dict from rank 0.
"""

from __future__ import annotations

import sys

import torch

from k3.config import ModelConfig
from k3.distributed import full_state_dict, init_distributed, is_main, shutdown
from k3.distributed.init import build_parallel_model


def main() -> None:
    ep, seed, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    env = init_distributed(device="cpu")
    model = build_parallel_model(ModelConfig.from_preset("debug"), env.device, ep_size=ep, seed=seed)
    local_bytes = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    state = full_state_dict(model)
    if is_main():
        torch.save({"state": state, "local_numel_rank0": local_bytes}, out)
    shutdown()


if __name__ == "__main__":
    main()
