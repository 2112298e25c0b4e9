"""A run trained under torchrun with expert parallelism (EP=2 on 2 gloo ranks), stopped and resumed with --ep,
reaches the same losses and weights as the unbroken run, with a gathered checkpoint.pt or a sharded one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.checkpoint.native import load_checkpoint
from k3.checkpoint.run import load_run_model, saved_format
from k3.train.metrics import read_metrics

WORKER = Path(__file__).with_name("dist_train_worker.py")
REPO = Path(__file__).resolve().parents[2]


def train(out: Path, corpus: Path, *extra: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               str(out), str(corpus), "2", *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"{command} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow  # 27-39 s on 2 cores: the default suite stays near 15 minutes
def test_ep2_run_resumed_under_ep2_matches_the_unbroken_run(tmp_path, corpus_dir):
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    train(unbroken, corpus_dir)
    train(broken, corpus_dir, "--stop-at", "5")  # the last checkpoint is from step 4: step 5 is redone
    assert load_checkpoint(broken)["step"] == 4
    train(broken, corpus_dir, "--resume")
    assert len(losses(unbroken)) == 6 and losses(broken) == losses(unbroken)
    a, b = load_checkpoint(unbroken), load_checkpoint(broken)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for number, entry in a["optimizer"]["state"].items():
        assert all(torch.equal(value, b["optimizer"]["state"][number][key]) for key, value in entry.items())


@pytest.mark.slow  # ~30 s of torchrun runs
def test_ep2_run_with_sharded_checkpoints_resumed_under_ep2_matches_the_unbroken_run(tmp_path, corpus_dir):
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    train(unbroken, corpus_dir)
    train(broken, corpus_dir, "--stop-at", "5", "--checkpoint-format", "sharded")
    assert saved_format(broken) == "sharded"
    train(broken, corpus_dir, "--resume")  # the format is the run's: sharded again
    assert saved_format(broken) == "sharded"
    assert len(losses(unbroken)) == 6 and losses(broken) == losses(unbroken)
    # Every rank wrote its own shards; one process reads them whole and equals rank 0's gathered checkpoint.
    reference = load_checkpoint(unbroken)["model"]
    model, meta = load_run_model(broken)
    assert meta["step"] == 6 and len(meta["data_per_rank"]) == 2
    assert all(torch.equal(reference[k], v) for k, v in model.state_dict().items())
