"""`torchrun --nproc-per-node 2 -m k3 rl` (gloo on CPU): each rank rolls out and trains its share of the
episodes, gradients summed over the ranks; the run equals one process to float noise (slow: two ranks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3.checkpoint.native import load_checkpoint
from tests.rl.callers import make_caller_run
from tests.rl.test_rollout_state import comparable

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def args(run, suite, out):
    return ["rl", "--from", str(run), "--suite", str(suite), "--out", str(out), "--algo", "grpo", "--group", "4",
            "--tasks-per-step", "2", "--steps", "2", "--lr", "1e-2", "--heldout-tasks", "0", "--device", "cpu",
            "--max-context", "1024", "--no-tis", "--save-every", "1"]


def test_two_ranks_train_as_one_process(sandbox_home, tokenizer, tmp_path):
    from k3.cli import main

    run, suite, _ = make_caller_run(tokenizer, tmp_path)
    assert main(args(run, suite, tmp_path / "one")) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "k3",
               *args(run, suite, tmp_path / "two"), "--threads", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    one, two = comparable(tmp_path / "one" / "metrics.jsonl"), comparable(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    assert all("loss" in r for r in one)  # two updates to compare
    for mine, theirs in zip(one, two):
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            if key in ("loss", "logprob_gap"):  # ~0 on policy: compared absolutely
                assert theirs[key] == pytest.approx(value, abs=1e-6), key
            elif isinstance(value, float):
                assert theirs[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
            else:
                assert theirs[key] == value, key
    assert load_checkpoint(tmp_path / "two")["parked"]["world"] == 2  # rank 0 gathered both ranks' state
    # Adam turns float noise (packing, the all-reduce's summation order) into weight differences of this order.
    a, b = load_checkpoint(tmp_path / "one")["model"], load_checkpoint(tmp_path / "two")["model"]
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(json.dumps({"max_weight_difference": worst}))
    assert worst < 1e-4, worst


def test_two_rank_resume_with_parked_groups_equals_the_unbroken_run(sandbox_home, tokenizer, tmp_path):
    """Under torchrun, a run stopped after step 1 with groups parked (each rank's share in the checkpoint) and
    resumed under torchrun with --steps 2 takes the same step 2 as the unbroken two-rank run."""
    run, suite, _ = make_caller_run(tokenizer, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "k3"]
    budget = ["--iteration-token-budget", "60", "--threads", "1"]

    def launch(extra):
        done = subprocess.run(torchrun + extra, env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
        assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"

    launch(args(run, suite, tmp_path / "unbroken") + budget)
    first = args(run, suite, tmp_path / "resumed")
    first[first.index("--steps") + 1] = "1"
    launch(first + budget)
    saved = load_checkpoint(tmp_path / "resumed")["parked"]
    assert saved["world"] == 2 and any(saved["groups"]), saved.keys()
    launch(["rl", "--out", str(tmp_path / "resumed"), "--resume", "--steps", "2", "--threads", "1"])
    records = comparable(tmp_path / "unbroken" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0].get("parked_groups", 0) > 0
    assert comparable(tmp_path / "resumed" / "metrics.jsonl") == records
    a, b = load_checkpoint(tmp_path / "unbroken")["model"], load_checkpoint(tmp_path / "resumed")["model"]
    assert all(a[k].equal(b[k]) for k in a)
