"""The length curriculum: rows follow the stage, tokens per step stay, and a resume on either side of a stage
change continues exactly like the unbroken run."""

import json

import pytest
import torch

from k3.checkpoint.native import load_checkpoint
from k3.cli import main
from k3.train.schedule import parse_seq_len_schedule, rows_for, stage_at
from k3.train.trainer import Trainer
from tests.train.conftest import _small_config, write_corpus


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run):
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r}


def test_parse_and_stage_lookup():
    stages = parse_seq_len_schedule("256:0, 1024:2000,4096:5000")
    assert stages == [[256, 0], [1024, 2000], [4096, 5000]]
    assert [stage_at(stages, s) for s in (0, 1999, 2000, 4999, 5000, 10**6)] == [0, 0, 1, 1, 2, 2]
    assert [rows_for(stages, i, 8) for i in range(3)] == [8, 2, 1]
    for bad, message in (("256:5", "must start at step 0"), ("256:0,512:0", "must increase"), ("256-0", "cannot read"),
                         ("1:0", "at least 2")):
        with pytest.raises(ValueError, match=message):
            parse_seq_len_schedule(bad)


SCHEDULE = [[16, 0], [32, 3]]


@pytest.fixture(scope="module")
def unbroken_run(tmp_path_factory):
    """(corpus, run): the unbroken run that both resume points are held to, trained once (it only is read)."""
    root = tmp_path_factory.mktemp("seq_len_schedule")
    corpus = write_corpus(root / "corpus")
    unbroken = root / "unbroken"
    Trainer(_small_config(unbroken, corpus, batch_size=4, seq_len_schedule=SCHEDULE), show_progress=False).train()
    return corpus, unbroken


@pytest.mark.parametrize("stop_at", [3, 5])  # last checkpoint before the change (step 2) and after it (step 4)
def test_resume_across_a_stage_change_matches_the_unbroken_run(tmp_path, unbroken_run, stop_at):
    corpus, unbroken = unbroken_run
    rows = {r["step"]: r for r in records(unbroken) if "loss" in r}
    assert [rows[s]["seq_len"] for s in range(1, 7)] == [16, 16, 16, 32, 32, 32]
    assert {rows[s]["tokens"] for s in range(1, 7)} == {64}  # 4 x 16 and then 2 x 32 tokens per step
    broken = tmp_path / "broken"
    Trainer(_small_config(broken, corpus, batch_size=4, seq_len_schedule=SCHEDULE), show_progress=False).train(
        stop_at=stop_at)
    assert load_checkpoint(broken / "checkpoint.pt")["step"] == stop_at - 1
    Trainer(_small_config(broken, corpus), resume=True, show_progress=False).train()
    assert losses(broken) == losses(unbroken)
    a, b = load_checkpoint(unbroken / "checkpoint.pt")["model"], load_checkpoint(broken / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_schedule(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--out", str(run), "--data", str(corpus_dir), "--max-steps", "3",
                 "--seq-len-schedule", "16:0,32:2", "--batch-size", "2", "--eval-batches", "1",
                 "--val-fraction", "0.2"]) == 0
    assert [r["seq_len"] for r in records(run) if "loss" in r] == [16, 16, 32]
    assert json.loads((run / "train_config.json").read_text())["data"]["seq_len_schedule"] == [[16, 0], [32, 2]]
    assert main(["train", "--preset", "debug", "--out", str(tmp_path / "bad"), "--seq-len-schedule", "16:1"]) == 1
    assert "must start at step 0" in capsys.readouterr().err
