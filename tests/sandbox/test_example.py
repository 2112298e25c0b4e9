"""The fork-rollout example runs end to end: 8 branches from one snapshot, each isolated."""

import importlib.util
import os

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "sandbox_fork_rollout.py")


def test_fork_rollout_example(sandbox_home, capsys):
    spec = importlib.util.spec_from_file_location("sandbox_fork_rollout", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main()  # asserts isolation itself
    out = capsys.readouterr().out
    assert "3 of 8 branches pass: [1, 2, 4]" in out
    assert out.count("PASS") == 3 and out.count("fail") == 5
