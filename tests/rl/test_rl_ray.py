"""Rollouts on Ray workers (each with a policy copy, an engine and its sandboxes; weights pushed after every
update) give the in-process run, parked partial rollouts and a resume included (slow: starts a local Ray)."""

from pathlib import Path

import pytest
import torch

from k3.rl.loop import RLConfig, RLTrainer
from tests.rl.callers import make_caller_run
from tests.rl.test_rollout_state import comparable

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'k3[ray]')")

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])


def config(run, suite, out, **fields):
    return RLConfig.flat(run=str(run), suite=str(suite), out=str(out), algo="grpo", group=4, tasks_per_step=2, steps=3,
                         lr=1e-2, heldout_tasks=0, save_every=1, device="cpu", max_context=1024,
                         iteration_token_budget=30, threads=2, tis_cap=None, **fields)


def digest(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def test_ray_rollout_workers_give_the_in_process_run(sandbox_home, tokenizer, tmp_path):
    run, suite, _ = make_caller_run(tokenizer, tmp_path)
    quiet = dict(show_progress=False, log=lambda *_: None)
    local = RLTrainer(config(run, suite, tmp_path / "local"), **quiet)
    local.train()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}})
    try:
        remote = RLTrainer(config(run, suite, tmp_path / "ray", ray="local", rollout_workers=2,
                                  rollout_timeout_s=300), **quiet)
        assert remote.engine is None and len(remote.runner.workers) == 2
        remote.train(stop_at=2)
        assert remote.runner.weights_digests() == [digest(remote.model)] * 2  # the update reached both workers
        parked = remote.runner.parked_state()
        remote.close()
        resumed = RLTrainer(RLConfig(out=str(tmp_path / "ray")), resume=True, **quiet)
        assert len(resumed.runner.parked) == len(parked["groups"]) > 0  # dealt out to the new workers
        resumed.train()
        resumed.close()
    finally:
        ray.shutdown()
    # The same tokens, rewards and routing, so the same update, bit for bit (the engine's logprobs agree only to
    # ~1e-7, another batch in another process: truncated IS is off here, they reach only logprob_gap).
    a, b = local.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = comparable(tmp_path / "local" / "metrics.jsonl")
    others = comparable(tmp_path / "ray" / "metrics.jsonl")
    assert [r["step"] for r in records] == [r["step"] for r in others] == [1, 2, 3]
    assert any("loss" in r for r in records)
    for mine, theirs in zip(records, others):
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            assert theirs[key] == (pytest.approx(value, abs=1e-6) if key == "logprob_gap" else value), key


def test_ray_workers_sample_in_the_rollout_dtype(sandbox_home, tokenizer, tmp_path):
    """--rollout-dtype reaches the Ray workers as it does the in-process engine (auto: bf16 on CUDA; forced to
    bf16 here, on CPU), and the fp32 weights pushed after an update arrive cast."""
    run, suite, _ = make_caller_run(tokenizer, tmp_path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}})
    try:
        trainer = RLTrainer(config(run, suite, tmp_path / "bf16", ray="local", rollout_workers=1,
                                   rollout_timeout_s=300, rollout_dtype="bf16"), show_progress=False,
                            log=lambda *_: None)
        assert trainer.runner.weights_dtypes() == ["torch.bfloat16"]
        record = trainer.train_step()
        assert record["step"] == 1 and "reward_mean" in record
        cast = float(sum(p.detach().bfloat16().double().sum() for p in trainer.model.parameters()))
        assert next(trainer.model.parameters()).dtype == torch.float32  # the policy itself stays fp32
        assert trainer.runner.weights_digests() == [cast]
        trainer.close()
    finally:
        ray.shutdown()
