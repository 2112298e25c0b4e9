"""The CPU demo end to end (slow: about a quarter of an hour on 2 cores): SFT on calc demonstrations, then RL;
RL must raise the held-out pass rate by more than twice the combined standard error."""

import json
import math

import pytest


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rl_demo_raises_the_heldout_pass_rate(sandbox_home, tmp_path):
    from k3.rl.demo import run_rl_demo

    summary = run_rl_demo(out=str(tmp_path / "demo"), json_path=str(tmp_path / "demo.json"), log=lambda *_: None)
    assert json.loads((tmp_path / "demo.json").read_text()) == summary
    assert summary["heldout_tasks"] >= 200 and summary["tool_calls_executed"] > 1000
    noise = math.hypot(summary["sft_standard_error"], summary["rl_standard_error"])
    assert summary["rl_pass_rate"] - summary["sft_pass_rate"] > 2 * noise, summary
