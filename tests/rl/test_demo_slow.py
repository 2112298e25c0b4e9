"""The CPU demo end to end (slow: about 10 minutes on 2 cores): SFT on calc demonstrations, then RL, with every
held-out tool call run in a sandbox.

What it checks is the demo's contract (200 held-out tasks, the tool calls executed, the JSON written, the
verdicts on improvement consistent with the numbers). It does not require RL to beat SFT: measured on
2026-12-02, RL left the greedy held-out pass rate at 0.910 (1 task gained, 1 lost) and the sampled one (mean of 4
episodes a task) at 0.834 -> 0.836."""

import json
import math

import pytest


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rl_demo_end_to_end(sandbox_home, tmp_path):
    from k3.rl.demo import run_rl_demo

    summary = run_rl_demo(out=str(tmp_path / "demo"), json_path=str(tmp_path / "demo.json"), log=lambda *_: None)
    assert json.loads((tmp_path / "demo.json").read_text()) == summary
    assert summary["heldout_tasks"] >= 200 and summary["tool_calls_executed"] > 1000
    assert 0.0 < summary["sft_pass_rate"] < 1.0  # SFT taught the format: some held-out tasks pass
    noise = math.hypot(summary["sft_standard_error"], summary["rl_standard_error"])
    assert summary["improved_beyond_noise"] == (summary["rl_pass_rate"] - summary["sft_pass_rate"] > 2 * noise)
    sampled = [summary["sft_pass_rate_sampled"], summary["rl_pass_rate_sampled"]]
    noise_sampled = math.hypot(*(math.sqrt(max(r * (1 - r), 1e-12) / summary["heldout_tasks"]) for r in sampled))
    assert summary["improved_beyond_noise_sampled"] == (sampled[1] - sampled[0] > 2 * noise_sampled)
    # the same held-out tasks before and after: gains minus losses is the change in the pass rate
    n = summary["heldout_tasks"]
    change = summary["rl_pass_rate"] - summary["sft_pass_rate"]
    assert summary["tasks_gained"] - summary["tasks_lost"] == round(change * n)
    assert summary["improved_beyond_paired_noise"] == (summary["paired_change"] > 2 * summary["paired_standard_error"])
    assert (tmp_path / "demo" / "rl" / "metrics.png").is_file()


def test_paired_change_counts_gains_and_losses_on_the_same_tasks():
    from k3.rl.demo import paired_change

    before = {"a": True, "b": False, "c": False, "d": True, "e": False}
    after = {"a": True, "b": True, "c": True, "d": False, "e": False, "extra": True}  # "extra" was not scored before
    change = paired_change(before, after)
    # 5 shared tasks: b and c gained, d lost -> +1/5; variance (3/5 - 0.04) / 5 = 0.112 -> se 0.33466
    assert change["tasks_gained"] == 2 and change["tasks_lost"] == 1
    assert change["paired_change"] == pytest.approx(0.2)
    assert change["paired_standard_error"] == pytest.approx(math.sqrt((0.6 - 0.04) / 5))
    unchanged = paired_change(before, before)
    assert unchanged["paired_change"] == 0.0 and unchanged["paired_standard_error"] == 0.0


def test_paired_change_of_sampled_shares_is_the_mean_difference():
    from k3.rl.demo import paired_change

    before = {"a": 0.25, "b": 1.0, "c": 0.5}  # shares of 4 samples that passed
    after = {"a": 0.75, "b": 0.75, "c": 0.5}
    change = paired_change(before, after)
    # d = (0.5, -0.25, 0): mean 1/12; mean(d^2) = 0.3125 / 3; se = sqrt((0.3125/3 - 1/144) / 3) = 0.180021
    assert change["tasks_gained"] == 1 and change["tasks_lost"] == 1
    assert change["paired_change"] == pytest.approx(1 / 12)
    assert change["paired_standard_error"] == pytest.approx(0.180021, abs=1e-6)
