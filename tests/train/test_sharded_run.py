"""Runs that keep sharded checkpoints (checkpoint_format="sharded": a torch.distributed.checkpoint directory)
resume exactly, switch format on resume, and load for generation and conversion like a checkpoint.pt run."""

from __future__ import annotations

import os

import pytest
import torch

from k3.checkpoint.native import load_checkpoint
from k3.checkpoint.run import load_run_model, saved_format
from k3.cli import main
from k3.train.metrics import read_metrics
from k3.train.trainer import Trainer


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def test_sharded_run_resumes_like_an_unbroken_run_and_loads_for_inference(tmp_path, corpus_dir, small_config):
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    Trainer(small_config(unbroken, corpus_dir), show_progress=False).train()
    sharded = small_config(broken, corpus_dir, checkpoint_format="sharded")
    Trainer(sharded, show_progress=False).train(stop_at=5)
    assert saved_format(broken) == "sharded" and not (broken / "checkpoint.pt").exists()
    resumed = Trainer(sharded, resume=True, show_progress=False)
    assert resumed.step == 4  # the last sharded save; step 5 is redone
    resumed.train()
    assert losses(broken) == losses(unbroken) and len(losses(broken)) == 6
    reference = load_checkpoint(unbroken)["model"]
    model, meta = load_run_model(broken)
    assert meta["step"] == 6 and "tokenizer.json" in meta["tokenizer"]
    assert all(torch.equal(reference[k], v) for k, v in model.state_dict().items())


def test_resume_can_switch_the_checkpoint_format(tmp_path, corpus_dir, small_config):
    run = tmp_path / "run"
    Trainer(small_config(run, corpus_dir, max_steps=2), show_progress=False).train()
    assert saved_format(run) == "full"
    Trainer(small_config(run, corpus_dir), resume=True, show_progress=False,
            resume_overrides={"max_steps": 4, "checkpoint_format": "sharded"}).train()
    assert saved_format(run) == "sharded" and not (run / "checkpoint.pt").exists()
    back = Trainer(small_config(run, corpus_dir), resume=True, show_progress=False,
                   resume_overrides={"max_steps": 6, "checkpoint_format": "full"})
    assert back.step == 4
    back.train()
    assert saved_format(run) == "full" and not (run / "checkpoint").exists()
    assert load_checkpoint(run)["step"] == 6


def test_cli_generates_and_converts_from_a_sharded_run(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--out", str(run), "--data", str(corpus_dir), "--max-steps", "2",
                 "--seq-len", "32", "--batch-size", "2", "--device", "cpu", "--checkpoint-format", "sharded"]) == 0
    assert "checkpoint/" in capsys.readouterr().out
    assert main(["generate", "--run", str(run), "--prompt", "def ", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["convert", "--from", str(run), "--to", str(tmp_path / "native"), "--format", "native"]) == 0
    converted = load_checkpoint(tmp_path / "native")
    model, _ = load_run_model(run)
    assert all(torch.equal(converted["model"][k], v) for k, v in model.state_dict().items())


def test_unfinished_sharded_checkpoint_is_not_resumed(tmp_path, corpus_dir, small_config):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)  # a directory without DCP's .metadata: no finished save
    with pytest.raises(FileNotFoundError, match="holds no finished checkpoint"):
        Trainer(small_config(run, corpus_dir), resume=True, show_progress=False)
    with pytest.raises(FileNotFoundError, match="not a finished sharded checkpoint"):
        load_run_model(run / "checkpoint")


def test_when_a_crash_leaves_both_kinds_the_newer_one_is_resumed(tmp_path, corpus_dir, small_config):
    run = tmp_path / "run"
    Trainer(small_config(run, corpus_dir, max_steps=2), show_progress=False).train()
    older = (run / "checkpoint.pt").read_bytes()
    Trainer(small_config(run, corpus_dir), resume=True, show_progress=False,
            resume_overrides={"max_steps": 4, "checkpoint_format": "sharded"}).train()
    (run / "checkpoint.pt").write_bytes(older)  # as if the save had died before removing the old kind
    os.utime(run / "checkpoint.pt", (1, 1))
    assert saved_format(run) == "sharded"
    assert Trainer(small_config(run, corpus_dir), resume=True, show_progress=False).step == 4
