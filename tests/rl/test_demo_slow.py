"""The CPU demo end to end (slow: about 8 CPU-minutes): SFT from a noisy teacher on arith
demonstrations, the headroom gate, then RL, with every tool call run in a sandbox.

It checks the demo's contract: at least 300 distinct held-out prompts, the tool calls executed, the JSON
written, the headroom gate on the training distribution (pass@k - pass@1 >= 0.3 before RL), and the verdicts
consistent with the numbers."""

import json
import math

import pytest


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rl_demo_end_to_end(sandbox_home, tmp_path):
    from k3.rl.demo import HEADROOM_GATE, TARGET_GAIN, TARGET_SE, run_rl_demo

    summary = run_rl_demo(out=str(tmp_path / "demo"), json_path=str(tmp_path / "demo.json"), log=lambda *_: None)
    assert json.loads((tmp_path / "demo.json").read_text()) == summary
    n = summary["heldout_tasks"]
    assert n >= 300 and summary["tool_calls_executed"] > 2500  # 3,071 measured
    assert summary["headroom_gate_passed"] == (summary["headroom_before"] >= HEADROOM_GATE)
    assert summary["headroom_before"] == pytest.approx(summary["train_pass_at_k_before"]
                                                       - summary["train_sampled_pass_rate_before"])
    assert summary["sft_pass_at_k"] >= summary["sampled_pass_rate_before"]
    # the same held-out tasks before and after: gains minus losses is the change in the pass rate
    change = summary["rl_pass_rate"] - summary["sft_pass_rate"]
    assert summary["tasks_gained"] - summary["tasks_lost"] == round(change * n)
    assert summary["paired_change"] == pytest.approx(change)
    assert summary["target_met"] == (change >= TARGET_GAIN
                                     and change > TARGET_SE * summary["paired_standard_error"])
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


def test_the_noisy_teacher_makes_one_item_independent_mistake(tmp_path):
    """The demo's warm start: in a fixed share of demonstrations (by a hash of the task id) the submitted answer
    gets the stray character, which the verifier rejects; nothing else in the demonstration changes."""
    from k3.rl.chat_format import format_tool_call, parse_tool_calls
    from k3.rl.demo import STRAY, add_teacher_noise, noisy_teacher, stray_chosen
    from k3.rl.tasks import Task, Verifier
    from k3.rl.verify import score

    messages = [{"role": "user", "content": "Compute 5*19-2."},
                {"role": "assistant", "content": format_tool_call("python", {"code": "x = 5*19-2\nprint(x)"})},
                {"role": "tool", "content": "93"},
                {"role": "assistant", "content": format_tool_call("submit", {"answer": "93"})}]
    noisy = noisy_teacher(messages)
    assert noisy[:-1] == messages[:-1]
    (call,) = parse_tool_calls(noisy[-1]["content"])
    assert call.name == "submit" and call.arguments["answer"] == "93" + STRAY
    task = Task(id="t", prompt="Compute 5*19-2.", verifier=Verifier("answer", expected="93", match="exact"))
    assert score(task, "93", None)[0] == 1.0 and score(task, call.arguments["answer"], None)[0] == 0.0
    with pytest.raises(ValueError, match="ends with one submit call"):
        noisy_teacher(messages[:2])
    # the share is the one asked for, and the same tasks are chosen every time
    keys = [f"arith-train-{i}" for i in range(4000)]
    chosen = [stray_chosen(k, 0.6) for k in keys]
    assert abs(sum(chosen) / len(keys) - 0.6) < 0.03 and chosen == [stray_chosen(k, 0.6) for k in keys]
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps({"task": k, "messages": messages}) + "\n" for k in keys[:50]))
    assert add_teacher_noise(path, 0.6) == sum(chosen[:50])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["messages"][-1]["content"].endswith(STRAY + '"}}</tool_call>') for r in rows] == chosen[:50]
