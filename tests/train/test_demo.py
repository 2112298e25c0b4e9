"""`k3 demo`, the README's first command, end to end on a short budget: it trains the tiny preset on this
machine's standard library, reports validation loss before and after, samples, measures recall, and leaves
a run that `k3 generate` can load."""

from __future__ import annotations

import json

import pytest
import torch

from k3.cli import main


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The demo sets torch's thread count for the process; the tests after this one keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # 27-39 s on 2 cores: the default suite stays near 15 minutes
def test_demo_runs_end_to_end_on_a_short_budget(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--minutes", "0.5", "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    for expected in ("validation loss:", "sample (temperature 0.7", "associative recall:", "length    63",
                     "length  1024", f"k3 generate --run {out}"):
        assert expected in printed, expected
    result = json.loads((out / "demo.json").read_text())
    assert result["steps"] >= 3 and result["last_val_loss"] < result["first_val_loss"]
    assert set(result["recall_accuracy"]) == {"63", "256", "1024"}
    assert all(0 <= a <= 1 for a in result["recall_accuracy"].values())
    assert (out / "checkpoint.pt").is_file() and (out / "metrics.png").is_file()
    # A second demo into the same directory starts over; another run's directory is refused.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["demo", "--minutes", "0.5", "--out", str(tmp_path / "other")]) != 0
    assert "is not a demo run" in capsys.readouterr().err
    assert main(["generate", "--run", str(out), "--prompt", "import ", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
