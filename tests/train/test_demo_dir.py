"""A demo's --out (k3 rl demo, k3 distill demo): cleared only when an earlier run of the same demo wrote it."""

import json

import pytest

from k3.train.run_dir import fresh_demo_dir


def test_a_folder_the_demo_did_not_write_is_refused_and_kept(tmp_path):
    out = tmp_path / "project"
    out.mkdir()
    (out / "mine.csv").write_text("1,2,3")
    with pytest.raises(ValueError, match="was not written by `k3 rl demo`"):
        fresh_demo_dir(out, "rl_demo.json", "k3 rl demo")
    assert sorted(p.name for p in out.iterdir()) == ["mine.csv"]


def test_an_earlier_run_of_the_demo_is_cleared(tmp_path):
    out = tmp_path / "demo"
    (out / "old").mkdir(parents=True)
    (out / "rl_demo.json").write_text('{"steps": 3}\n')
    assert fresh_demo_dir(out, "rl_demo.json", "k3 rl demo") == out
    assert sorted(p.name for p in out.iterdir()) == ["rl_demo.json"]
    assert json.loads((out / "rl_demo.json").read_text()) == {}
