"""Training: the loop skeleton every trainer runs (loop.py: train, sft, rl, distill) and the run directory they write
(run_dir.py), the LM trainer (trainer.py), AdamW + warmup/cosine (optim.py), metrics and plots (metrics.py), the
`k3 train` and `k3 demo` commands (cli.py, demo.py)."""

from k3.train.config import (CheckpointConfig, DataConfig, EvalConfig, ImageConfig, OptimConfig, ParallelConfig,
                             RecallConfig, TrainConfig)
from k3.train.trainer import NonFiniteLossError, Trainer, train

__all__ = ["NonFiniteLossError", "TrainConfig", "DataConfig", "OptimConfig", "ParallelConfig", "EvalConfig",
           "CheckpointConfig", "RecallConfig", "ImageConfig", "Trainer", "train"]
