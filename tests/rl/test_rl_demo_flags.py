"""`k3 rl demo` honours the flags it takes and refuses, by name, the RL flags it would otherwise ignore."""

import pytest

from k3.cli import build_parser
from k3.rl.cli import demo_options


def parse(*argv):
    return build_parser().parse_args(["rl", "demo", *argv])


def test_demo_flags_reach_run_rl_demo_under_its_own_names():
    args = parse("--steps", "40", "--heldout-tasks", "400", "--tasks-per-step", "32", "--group", "4",
                 "--lr", "2e-4", "--seed", "3", "--threads", "1", "--algo", "grpo")
    assert demo_options(args) == {"rl_steps": 40, "heldout": 400, "tasks_per_step": 32, "group": 4, "lr": 2e-4,
                                  "seed": 3, "threads": 1, "algo": "grpo"}
    assert demo_options(parse()) == {"threads": 0}  # run_rl_demo's own defaults (--threads defaults to its 0)


def test_a_flag_set_to_zero_is_passed_not_dropped():
    args = parse("--seed", "0", "--steps", "0", "--heldout-tasks", "0", "--lr", "0", "--threads", "0")
    assert demo_options(args) == {"seed": 0, "rl_steps": 0, "heldout": 0, "lr": 0.0, "threads": 0}


@pytest.mark.parametrize("argv, flag", [(["--temperature", "0.7"], "--temperature"),
                                        (["--suite", "fix"], "--suite"), (["--no-tis"], "--no-tis"),
                                        (["--resume"], "--resume"), (["--no-routing-replay"], "--no-routing-replay")])
def test_a_flag_the_demo_cannot_honour_is_refused_by_name(argv, flag):
    with pytest.raises(ValueError, match=f"does not take {flag}"):
        demo_options(parse(*argv))


@pytest.mark.parametrize("options, name", [({"group": 1}, "group"), ({"heldout": 0}, "heldout"),
                                           ({"rl_steps": -1}, "rl_steps"), ({"demos": 0}, "demos")])
def test_an_out_of_range_value_is_refused_before_anything_is_written(tmp_path, options, name):
    from k3.rl.demo import run_rl_demo

    out = tmp_path / "demo"
    with pytest.raises(ValueError, match=f"{name} must be >= "):
        run_rl_demo(out=str(out), **options)
    assert not out.exists()


def test_a_zero_learning_rate_is_refused(tmp_path):
    from k3.rl.demo import run_rl_demo

    with pytest.raises(ValueError, match="lr and sft_lr must be > 0"):
        run_rl_demo(out=str(tmp_path / "demo"), lr=0.0)
