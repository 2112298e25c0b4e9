"""bench/ep_layer.py: its Zipf-exponent solver, and its `--cpu --tiny` run on 2 gloo processes, checked through
the JSON it writes (balance, realised skew, positive times, plain and balanced layers agreeing)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from tests.distributed.launching import run_launch, torchrun

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "ep_layer.py"
RANKS = 2


@pytest.fixture
def ep_layer(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))  # the bench imports its neighbours by bare name
    return importlib.import_module("ep_layer")


def test_pick_probabilities_sum_to_top_k_and_match_closed_forms(ep_layer):
    # Every token picks exactly k experts, so the pick probabilities of all experts sum to k.
    for experts, top_k, skew in ((8, 2, 0.0), (8, 2, 1.0), (16, 4, 0.6), (16, 4, 3.0)):
        total = sum(ep_layer.pick_probability(skew, experts, top_k, e) for e in range(experts))
        assert abs(total - top_k) < 1e-9, (experts, top_k, skew, total)
    # Top-1: the hottest expert is picked with its normalised popularity; uniform: k / E.
    popularity = (torch.arange(8, dtype=torch.float64) + 1) ** -1.5
    assert abs(ep_layer.pick_probability(1.5, 8, 1) - float(popularity[0] / popularity.sum())) < 1e-9
    assert abs(ep_layer.pick_probability(0.0, 16, 4) - 0.25) < 1e-9


def test_solved_exponent_hits_the_target_and_bad_targets_are_refused(ep_layer):
    for target in (0.5, 2.0):
        skew = ep_layer.solve_zipf_exponent(target, 8, 2)
        assert skew > 0
        assert abs(ep_layer.expected_maxvio(skew, 8, 2) - target) <= 1e-4
    with pytest.raises(ValueError, match="out of reach"):
        ep_layer.solve_zipf_exponent(3.0, 8, 2)  # 8 experts, top-2: maxvio is at most 8 / 2 - 1 = 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("ep_layer") / "ep_layer.json"
    done = run_launch(torchrun(RANKS) + [str(BENCH), "--cpu", "--tiny", "--json", str(out)], "ep_layer.py", 600)
    return json.loads(out.read_text()), done.stdout


def test_tiny_run_prints_and_records_every_case(tiny_run):
    result, stdout = tiny_run
    assert stdout.startswith("command: torchrun --standalone --nproc-per-node 2 ")
    assert "[CPU functional run: not a performance result]" in stdout
    assert result["cpu_functional_run"] and result["world_size"] == RANKS
    routings = [case["routing"] for case in result["cases"]]
    assert routings == ["uniform", "maxvio=0.5", "maxvio=2"] * 2
    assert result["link_peak"]["all_to_all_gbps"] > 0 and result["link_peak"]["peer_copy_gbps"] is None
    for case in result["cases"]:
        pairs = case["global_tokens"] * result["layer"]["num_experts_per_tok"]
        assert set(case["plans"]) == {"plain", "balanced"}
        for plan in case["plans"].values():
            assert sum(plan["pairs_per_rank"]) == pairs


def test_tiny_run_balances_the_skewed_cases(tiny_run):
    for case in tiny_run[0]["cases"]:
        plain, balanced = case["plans"]["plain"], case["plans"]["balanced"]
        assert balanced["max_over_mean"] == 1.0, (case["routing"], balanced["pairs_per_rank"])
        if case["target_maxvio"] is not None:
            # The hot experts all live on rank 0 (expected plain max/mean 1.18 and 1.6 for the two targets).
            assert plain["max_over_mean"] > 1.1, (case["routing"], plain["pairs_per_rank"])
            assert balanced["replicas"] > 0


def test_tiny_run_realises_the_target_maxvio(tiny_run):
    """The realised maxvio is the hottest expert's load over the exact mean load T k / E, minus 1; that load is
    binomial(T, (1 + target) k / E) (each token picks the expert independently), so its standard deviation is
    known. 4 standard deviations (a false alarm about once in 16000) must stay within 25% of the target at
    these sizes, which the assertion on `tolerance` checks."""
    result = tiny_run[0]
    experts, top_k = result["layer"]["num_experts"], result["layer"]["num_experts_per_tok"]
    for case in result["cases"]:
        target = case["target_maxvio"]
        if target is None:
            continue
        share = (1 + target) * top_k / experts
        std = math.sqrt(case["global_tokens"] * share * (1 - share)) / (case["global_tokens"] * top_k / experts)
        assert abs(case["maxvio_sampling_std"] - std) < 1e-12
        tolerance = 4 * std
        assert tolerance <= 0.25 * target
        assert abs(case["realised_maxvio"] - target) <= tolerance, (case["routing"], case["realised_maxvio"])
        assert abs(case["expected_maxvio"] - target) <= 1e-4


def test_tiny_run_times_and_rates_are_positive(tiny_run):
    for case in tiny_run[0]["cases"]:
        for name, plan in case["plans"].items():
            for key, value in plan.items():
                if key == "replica_weights_s" and plan["replicas"] == 0:
                    assert value is None  # no replica, nothing exchanged
                elif key.endswith(("_s", "gbps", "per_rank", "total")) and key != "pairs_per_rank":
                    values = value if isinstance(value, list) else [value]
                    assert values and all(v > 0 for v in values), (case["routing"], name, key, value)


def test_tiny_run_plain_and_balanced_layers_agree(tiny_run):
    """Same inputs, routing and weights: the balanced plan only moves pieces of experts to other ranks, so the
    output and gradients match the plain plan's up to float32 summation order (an expert's gradient is summed
    from its pieces)."""
    for case in tiny_run[0]["cases"]:
        for name, diff in case["plain_vs_balanced"].items():
            assert diff["max_abs"] > 0, (case["routing"], name)
            assert diff["max_abs_diff"] <= 1e-5 * diff["max_abs"], (case["tokens_per_rank"], case["routing"], name,
                                                                   diff)
