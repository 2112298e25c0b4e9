"""`k3 distill demo` at a few steps: its --json has, per domain, the keys the issue names and every arm's."""

import json
import math

import pytest

from k3.rl.distill_demo import ARMS, KEYS, run_distill_demo


@pytest.mark.slow  # 27-39 s on 2 cores: the default suite stays near 15 minutes
def test_the_demo_writes_every_domain_and_arm(tmp_path):
    lines = []
    summary = run_distill_demo(out=str(tmp_path / "demo"), teacher_steps=3, student_steps=2, distill_steps=2,
                               prompts_per_domain=2, samples=2, json_path=str(tmp_path / "demo.json"), threads=1,
                               log=lines.append)
    assert json.loads((tmp_path / "demo.json").read_text()) == summary
    assert set(summary["domains"]) == {"code", "docs"}
    for row in summary["domains"].values():
        for key in ("student_kl_before", "student_kl_after", "offline_kl_after", "teacher_heldout_nll",
                    "student_heldout_nll_before", "student_heldout_nll_after"):
            assert math.isfinite(row[key]), key
        for label, _ in ARMS:
            assert math.isclose(row[f"{KEYS[label]}_gap_closed"],
                                1 - row[f"{KEYS[label]}_kl_after"] / row["student_kl_before"])
    assert any(line.startswith("code ") for line in lines) and any(line.startswith("docs ") for line in lines)
