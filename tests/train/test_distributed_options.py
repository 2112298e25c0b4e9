"""`k3 train --ep` options reach the layers: --ep-balanced makes every rank compute the same number of
token-expert pairs, and --qb-aggregate histogram switches Quantile Balancing to all-reduced histograms.
The run then trains like the plain one (EP=2 on 2 gloo ranks)."""

from __future__ import annotations

import json

import pytest

from test_distributed_resume import losses, train


@pytest.mark.slow  # 27-39 s on 2 cores: the default suite stays near 15 minutes
def test_balanced_dispatch_and_histogram_qb_train_like_the_plain_run(tmp_path, corpus_dir):
    plain, options = tmp_path / "plain", tmp_path / "options"
    train(plain, corpus_dir)
    train(options, corpus_dir, "--ep-balanced", "--qb-aggregate", "histogram")
    wiring = json.loads((options / "wiring.json").read_text())
    assert wiring["balanced"] == [True] * 3 and wiring["histogram"] == [True] * 3  # debug: 3 MoE layers
    assert all(len(set(pairs)) == 1 for pairs in wiring["pairs_per_rank"]), wiring["pairs_per_rank"]
    reference = json.loads((plain / "wiring.json").read_text())
    assert reference["balanced"] == [False] * 3 and reference["histogram"] == [False] * 3
    # Balanced dispatch changes no output; histogram QB places the biases as the exact gather does, to
    # ~1e-3 in bias (measured: losses within 2e-4 relative over these 6 steps), so few choices differ.
    a, b = losses(plain), losses(options)
    assert a.keys() == b.keys() and len(a) == 6
    assert all(abs(a[s] - b[s]) <= 2e-3 * abs(a[s]) for s in a), (a, b)
    assert b[6] < b[1]
