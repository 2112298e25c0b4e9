"""Distributed training on CPU with gloo: loss parity across EP layouts, balanced dispatch under skew,
checkpoints across layouts, and the plan arithmetic the dispatcher relies on.

Multi-process tests launch tests/distributed/worker.py with torchrun (one subprocess per layout; the
one-process layouts run it in this process) and compare the JSON each layout writes. Model: the debug preset
(8 experts, top-2) in float64. Layouts: 1 process; EP=2 on 2 ranks; EP=2 on 4 ranks (two EP groups, each a
replica of the experts; 8 steps in the parity tests, 2 for the checkpoint test of the default run); EP=4 (slow).
The trained runs chain their checkpoints: 1 process -> EP=2 on 2 ranks -> EP=2 on 4 ranks -> 1 process / EP=4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.config import ModelConfig
from k3.distributed.balanced import balanced_plan, imbalance
from k3.distributed.dispatcher import _piece_overlap, home_plan, source_to_slot_order
from k3.distributed.parallelize import check_ep_size, parallelize
from k3.model import K3ForCausalLM
from tests.distributed import worker
from tests.distributed.launching import REPO, run_scenario

WORKER = Path(__file__).with_name("worker.py")
# A layout that parts from one process shows from the first steps (losses agree to ~1e-7 when right); 8 steps
# still see the loss fall and the Adam moments and QB biases carried across several updates.
STEPS = 8


def launch(tmp_path: Path, name: str, nproc: int, *args: str) -> dict:
    """Run one worker scenario on `nproc` processes and return rank 0's JSON. One process is this one: a fresh
    interpreter spent ~5 s importing torch and k3 (the worker sees no torchrun environment either way)."""
    out = tmp_path / f"{name}.json"
    if nproc == 1:
        assert worker.main([*args, "--out", str(out)]) == 0
        return json.loads(out.read_text())
    return run_scenario(WORKER, out, name, nproc, args, timeout=900)


def assert_losses_match(reference: list[float], got: list[float], rtol: float = 1e-5) -> None:
    assert len(reference) == len(got) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, got))
    assert worst <= rtol, f"losses differ by {worst:.3e} relative (allowed {rtol:.0e}):\n{reference}\n{got}"


def assert_same_biases(reference: list[list[float]], got: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference), rtol=0, atol=1e-5)


def assert_same_logits(reference: list, got: list) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference), rtol=1e-12, atol=1e-12)


def assert_trains_like_one_process(reference: dict, got: dict) -> None:
    """Same losses, router biases equal on every rank and equal the single process's, same gradient norm
    (clip_grad_norm_ over the layout's meshes) and clipping to half of it leaves half."""
    assert_losses_match(reference["losses"], got["losses"])
    assert got["biases_agree"], "QB biases differ between ranks"
    assert_same_biases(reference["bias"], got["bias"])
    norm, clipped = got["grad_norms"]
    assert norm == pytest.approx(reference["grad_norms"][0], rel=1e-5)
    assert clipped == pytest.approx(norm / 2, rel=1e-5)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> tuple[dict, Path]:
    """The reference: one process, no parallelism, STEPS steps; its checkpoint is loaded by the EP=2 run."""
    tmp = tmp_path_factory.mktemp("ep1")
    checkpoint = tmp / "ep1.pt"
    return launch(tmp, "ep1", 1, "train", "--steps", str(STEPS), "--checkpoint", str(checkpoint)), checkpoint


@pytest.fixture(scope="module")
def ep2_two_ranks(single_process, tmp_path_factory) -> tuple[dict, Path]:
    """EP=2 on 2 ranks: trains, saves its checkpoint, then loads the single process's; then, in the same launch
    (a start-up of 2 ranks is ~5 s on 2 cores), both two-rank skew cases of balanced_two_ranks."""
    tmp = tmp_path_factory.mktemp("ep2")
    checkpoint = tmp / "ep2.pt"
    return launch(tmp, "ep2", 2, "train", "--steps", str(STEPS), "--checkpoint", str(checkpoint),
                  "--load", str(single_process[1]), "--hot", "0,1", "--hot", "0"), checkpoint


@pytest.fixture(scope="module")
def ep2_four_ranks_short(ep2_two_ranks, tmp_path_factory) -> tuple[dict, Path]:
    """EP=2 on 4 ranks for the checkpoint tests of the default run: 2 steps instead of STEPS (the 4-rank start-up
    alone is ~25 s of CPU on 2 cores; the STEPS-step fixture below is for the slow parity tests). Saves its
    checkpoint, then loads the EP=2-on-2-ranks one."""
    tmp = tmp_path_factory.mktemp("ep2x4_short")
    checkpoint = tmp / "ep2x4_short.pt"
    return launch(tmp, "ep2x4_short", 4, "train", "--ep", "2", "--steps", "2", "--checkpoint", str(checkpoint),
                  "--load", str(ep2_two_ranks[1])), checkpoint


@pytest.fixture(scope="module")
def ep2_four_ranks(ep2_two_ranks, tmp_path_factory) -> tuple[dict, Path]:
    """EP=2 on 4 ranks (2 EP groups x 2 ranks; the groups are data-parallel replicas of the experts): trains,
    saves its checkpoint, then loads the EP=2-on-2-ranks one."""
    tmp = tmp_path_factory.mktemp("ep2x4")
    checkpoint = tmp / "ep2x4.pt"
    return launch(tmp, "ep2x4", 4, "train", "--ep", "2", "--steps", str(STEPS), "--checkpoint", str(checkpoint),
                  "--load", str(ep2_two_ranks[1])), checkpoint


def test_ep2_matches_one_process(single_process, ep2_two_ranks):
    reference, ep2 = single_process[0], ep2_two_ranks[0]
    assert_trains_like_one_process(reference, ep2)
    assert reference["losses"][-1] < reference["losses"][0], "the run did not train"
    # EP=1 checkpoint loaded under EP=2 gives the EP=1 model's logits exactly.
    assert_same_logits(reference["logits"], ep2["loaded_logits"][0])
    # The two trained models are close but not the same tensor: the loads really moved weights.
    assert torch.tensor(ep2["logits"]).ne(torch.tensor(reference["logits"])).any()


@pytest.mark.slow  # four ranks (~30 s); test_ep2_matches_one_process covers EP in the default run
def test_ep2_on_four_ranks_matches_one_process(single_process, ep2_two_ranks, ep2_four_ranks):
    reference, ep2, ep2x4 = single_process[0], ep2_two_ranks[0], ep2_four_ranks[0]
    assert_trains_like_one_process(reference, ep2x4)
    # EP=2-on-2-ranks checkpoint loaded under EP=2 on 4 ranks gives that model's logits exactly.
    assert_same_logits(ep2["logits"], ep2x4["loaded_logits"][0])
    assert torch.tensor(ep2x4["logits"]).ne(torch.tensor(ep2["logits"])).any()


def test_ep2_checkpoints_load_in_one_process(ep2_two_ranks, ep2_four_ranks_short, tmp_path):
    """Both EP=2 layouts' checkpoints load into a single process (plain load_state_dict) with their logits, and
    the EP=2-on-2-ranks one loads under EP=2 on 4 ranks with its logits."""
    (ep2, ep2_checkpoint), (ep2x4, ep2x4_checkpoint) = ep2_two_ranks, ep2_four_ranks_short
    assert_same_logits(ep2["logits"], ep2x4["loaded_logits"][0])
    assert torch.tensor(ep2x4["logits"]).ne(torch.tensor(ep2["logits"])).any()  # the load moved weights
    loaded = launch(tmp_path, "ep1_load", 1, "load", "--load", str(ep2_checkpoint), "--load", str(ep2x4_checkpoint))
    assert_same_logits(ep2["logits"], loaded["loaded_logits"][0])
    assert_same_logits(ep2x4["logits"], loaded["loaded_logits"][1])


@pytest.mark.slow
def test_ep4_matches_one_process(single_process, ep2_four_ranks, tmp_path):
    reference, (ep2x4, ep2x4_checkpoint) = single_process[0], ep2_four_ranks
    ep4 = launch(tmp_path, "ep4", 4, "train", "--steps", str(STEPS), "--load", str(ep2x4_checkpoint))
    assert_trains_like_one_process(reference, ep4)
    # EP=2-on-4-ranks checkpoint loaded under EP=4.
    assert_same_logits(ep2x4["logits"], ep4["loaded_logits"][0])


@pytest.mark.slow
def test_ep2_balanced_training_matches_one_process(single_process, tmp_path):
    reference, _ = single_process
    balanced = launch(tmp_path, "ep2_balanced", 2, "train", "--steps", str(STEPS), "--balanced")
    assert_losses_match(reference["losses"], balanced["losses"])


def test_parallelize_rejects_ep_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match=r"--ep\) 3 does not split the 4 ranks .* \[1, 2, 4\]"):
        check_ep_size(3, world_size=4, num_experts=8)
    with pytest.raises(ValueError, match=r"6 experts cannot be split evenly over EP=4 .* \[1, 2\]"):
        check_ep_size(4, world_size=8, num_experts=6)
    with pytest.raises(ValueError, match="at least 1"):
        check_ep_size(0, world_size=4, num_experts=8)
    check_ep_size(2, world_size=4, num_experts=8)
    # In one process (no torchrun) EP=2 has no ranks to use: parallelize says so before touching the model.
    model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    with pytest.raises(ValueError, match="does not split the 1 ranks.*launch 2 or a multiple of 2 processes"):
        parallelize(model, ep_size=2)
    assert not hasattr(model, "parallel_layout")


def check_balanced(result: dict, nproc: int, min_plain_imbalance: float = 1.5) -> None:
    for plain, balanced in zip(result["pairs_plain"], result["pairs_balanced"]):
        assert sum(plain) == sum(balanced)
        assert imbalance(plain) > min_plain_imbalance, f"the router was not skewed: plain pairs per rank {plain}"
        assert len(balanced) == nproc and imbalance(balanced) == 1.0, f"unbalanced: {balanced}"
    assert all(n > 0 for n in result["replicas_balanced"])
    assert len(result["pairs_balanced"]) == 3  # one entry per MoE layer of the debug preset
    assert result["max_logit_diff"] <= 1e-12 * max(1.0, result["max_logit"])
    assert result["max_grad_diff"] <= 1e-12 * max(1.0, result["max_grad"])
    assert any("block_sparse_moe.w1" in name for name in result["grad_names"])


@pytest.fixture(scope="module")
def balanced_two_ranks(ep2_two_ranks) -> dict:
    """Both two-rank skew cases, run after the EP=2 training in its launch (each on a freshly built model):
    {hot experts: result}."""
    return ep2_two_ranks[0]["balanced"]


def test_balanced_dispatch_under_skew_two_ranks(balanced_two_ranks):
    # Experts 0 and 1 live on rank 0: the plain dispatch puts every pair there.
    check_balanced(balanced_two_ranks["0,1"], 2)


def test_balanced_dispatch_when_a_rank_computes_home_pairs_and_replicas(balanced_two_ranks):
    # Only expert 0 is hot: every token takes it plus a second expert of its own choice, so rank 1 computes
    # pairs of its home experts (4..7) and a replica of expert 0, whose id sorts before them.
    check_balanced(balanced_two_ranks["0"], 2, min_plain_imbalance=1.2)


@pytest.mark.slow
def test_balanced_dispatch_under_skew_four_ranks(tmp_path):
    # Experts 0, 1 (rank 0) and 5 (rank 2) hot: two overloaded ranks shed onto two idle ones.
    check_balanced(launch(tmp_path, "balanced4", 4, "balanced", "--hot", "0,1,5")["0,1,5"], 4)


# --- plan arithmetic, in one process ---------------------------------------------------------------------

def skewed_counts(generator: torch.Generator, ranks: int, experts: int, pairs_per_rank: int) -> torch.Tensor:
    """[R, E] counts: each rank's pairs drawn from a sharply peaked expert distribution."""
    weights = torch.rand(experts, generator=generator) ** 8
    weights[torch.randint(experts, (1,), generator=generator)] += 5.0
    counts = torch.zeros(ranks, experts, dtype=torch.long)
    for r in range(ranks):
        picks = torch.multinomial(weights, pairs_per_rank, replacement=True, generator=generator)
        counts[r] = torch.bincount(picks, minlength=experts)
    return counts


@pytest.mark.parametrize("ranks,experts", [(2, 8), (4, 8), (4, 16), (8, 64)])
def test_balanced_plan_gives_every_rank_the_same_pairs(ranks, experts):
    generator = torch.Generator().manual_seed(ranks * 100 + experts)
    for trial in range(20):
        counts = skewed_counts(generator, ranks, experts, pairs_per_rank=96 + 8 * trial)
        plan = balanced_plan(counts)
        assert plan.pairs_per_rank() == [int(counts.sum()) // ranks] * ranks
        per_expert = counts.sum(0).tolist()
        pieces_of = {}
        for e, r, n in zip(plan.piece_expert, plan.piece_rank, plan.piece_count):
            pieces_of.setdefault(e, []).append((r, n))
        for e in range(experts):
            owners = [r for r, _ in pieces_of[e]]
            assert sum(n for _, n in pieces_of[e]) == per_expert[e]
            assert plan.home(e) in owners and len(set(owners)) == len(owners) and owners == sorted(owners)
        for e, r in plan.replicas():
            assert pieces_of[e][[o for o, _ in pieces_of[e]].index(r)][1] > 0
        # Plans are pure functions of the counts: every rank computes the same one.
        assert balanced_plan(counts.clone()) == plan


def test_balanced_plan_keeps_balanced_routing_at_home():
    counts = torch.full((4, 8), 6, dtype=torch.long)
    plan = balanced_plan(counts)
    assert plan.replicas() == [] and plan == home_plan(counts)


def test_balanced_plan_rejects_uneven_expert_split():
    with pytest.raises(ValueError, match="cannot be split evenly"):
        balanced_plan(torch.ones(3, 8, dtype=torch.long))


def test_piece_overlap_matches_a_pair_by_pair_count():
    generator = torch.Generator().manual_seed(3)
    counts = skewed_counts(generator, 4, 8, pairs_per_rank=50)
    plan = balanced_plan(counts)
    overlap = _piece_overlap(counts, plan)
    expected = torch.zeros_like(overlap)
    for e in range(8):
        owners = [(p, n) for p, (pe, n) in enumerate(zip(plan.piece_expert, plan.piece_count)) if pe == e]
        slot_of_position = [p for p, n in owners for _ in range(n)]  # the expert's pair list, cut into pieces
        position = 0
        for r in range(4):
            for _ in range(int(counts[r, e])):
                expected[r, slot_of_position[position]] += 1
                position += 1
    assert torch.equal(overlap, expected)
    assert torch.equal(overlap.sum(0), torch.tensor(plan.piece_count))


def test_source_to_slot_order_is_a_transpose_of_segments():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    # Source-major rows: r0s0 r0s0 r0s2 | r1s0 r1s1 r1s1 r1s1 -> slot-major: s0 (r0 r0 r1), s1 (r1 x3), s2 (r0).
    assert source_to_slot_order(counts).tolist() == [0, 1, 3, 4, 5, 6, 2]


@pytest.mark.slow
def test_k3_train_with_ep_under_torchrun(tmp_path):
    """`torchrun -m k3 train --ep 2` trains, and its checkpoint opens as a single-device model."""
    from k3.checkpoint.native import load_checkpoint, model_from_checkpoint

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = ["expert", "latent", "router", "token", "balance", "rank", "shard", "gather", "delta", "kimi"]
    generator = torch.Generator().manual_seed(0)
    for doc in range(6):
        picks = torch.randint(len(words), (3000,), generator=generator).tolist()
        (corpus / f"doc{doc}.txt").write_text(" ".join(words[i] for i in picks))
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "k3", "train",
         "--preset", "tiny", "--out", str(out), "--data", str(corpus), "--max-steps", "3", "--seq-len", "64",
         "--batch-size", "2", "--eval-every", "3", "--save-every", "3", "--eval-batches", "1", "--device", "cpu",
         "--threads", "1", "--ep", "2"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    state = load_checkpoint(out / "checkpoint.pt")
    assert state["step"] == 3
    model = model_from_checkpoint(state)
    assert model.model.layers[1].block_sparse_moe.w1.shape[0] == model.config.num_experts
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert any('"step": 3' in line and '"loss"' in line for line in lines)
