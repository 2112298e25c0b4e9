"""Training: the loop skeleton every trainer runs (loop.py: train, sft, rl, distill) and the run directory they write
(run_dir.py), the LM trainer (trainer.py), AdamW + warmup/cosine (optim.py), metrics and plots (metrics.py), the
`k3 train` and `k3 demo` commands (cli.py, demo.py)."""

from k3.train.trainer import NonFiniteLossError, TrainConfig, Trainer, train

__all__ = ["NonFiniteLossError", "TrainConfig", "Trainer", "train"]
