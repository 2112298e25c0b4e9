"""Quantile Balancing aggregated by histograms: on one rank it places every untied expert's bias where the
exact sort does; over two gloo ranks both ranks get the same bias, equal to the one-process answer on the
union of their tokens."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.layers.balancing import (QB_HISTOGRAM_BINS, QB_MAX_ITERS, published_bias, published_bias_histogram, quantile_bias,
                                  quantile_bias_histogram, required_bias)

T, E, K = 2048, 16, 2


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(T, E, generator=generator) + torch.linspace(-1.0, 1.5, E))
    return scores, torch.randn(E, generator=generator) * 0.05


def untied_received(scores: torch.Tensor, old_bias: torch.Tensor, new_bias: torch.Tensor):
    required = required_bias(scores, old_bias, K)
    quota = K * scores.shape[0] // E
    ordered = required.sort(dim=0).values
    untied = ordered[quota - 1] < ordered[quota]
    return (required < new_bias).sum(0), untied, quota


def test_histogram_quantile_matches_exact_on_one_rank():
    scores, old = batch()
    histogram = quantile_bias_histogram(scores, old, K, lambda tensor, op: tensor, center=False)
    received, untied, quota = untied_received(scores, old, histogram)
    assert untied.sum() >= E - 3
    assert torch.all(received[untied] == quota), received.tolist()
    exact = quantile_bias(scores, old, K, center=False)
    assert torch.allclose(histogram[untied], exact[untied], atol=1e-3)


def _reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    dist.all_reduce(tensor, op=ops[op])
    return tensor


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Both histogram rules on this rank's shard, in one process group (one spawn for both tests)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        scores, old = batch()
        shard = scores.chunk(world)[rank]
        bias = quantile_bias_histogram(shard, old, K, _reduce, center=False)
        torch.save(bias, os.path.join(out_dir, f"bias{rank}.pt"))
        published = published_bias_histogram(shard, old, K, _reduce)
        torch.save(published, os.path.join(out_dir, f"published_bias{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_gloo_ranks() -> dict[str, list[torch.Tensor]]:
    """{"iterated": [rank 0's bias, rank 1's], "published": [...]} from two spawned gloo ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        mp.spawn(_rank_main, args=(2, init_file, out_dir), nprocs=2, join=True)
        return {rule: [torch.load(os.path.join(out_dir, f"{prefix}bias{r}.pt")) for r in range(2)]
                for rule, prefix in (("iterated", ""), ("published", "published_"))}


def test_histogram_quantile_agrees_across_two_gloo_ranks(two_gloo_ranks):
    biases = two_gloo_ranks["iterated"]
    assert torch.equal(biases[0], biases[1])
    scores, old = batch()
    received, untied, quota = untied_received(scores, old, biases[0])
    assert torch.all(received[untied] == quota), received.tolist()
    one_rank = quantile_bias_histogram(scores, old, K, lambda tensor, op: tensor, center=False)
    torch.testing.assert_close(biases[0][untied], one_rank[untied], rtol=0, atol=1e-6)


def test_router_uses_histogram_aggregation_when_given_a_reduce():
    from k3.config import ModelConfig
    from k3.layers.moe import Router

    config = ModelConfig.from_preset("debug", num_experts=E, num_experts_per_tok=K)
    routers = [Router(config), Router(config)]
    for router in routers:
        router.qb_max_iters = QB_MAX_ITERS  # the iterated rule (the published one has its own tests below)
    torch.nn.init.normal_(routers[0].weight, std=0.5)
    routers[1].load_state_dict(routers[0].state_dict())
    routers[1].reduce = lambda tensor, op: tensor
    x = torch.randn(512, config.hidden_size)
    chosen = [r(x).topk_ids_TK for r in routers]
    assert not torch.equal(routers[1].e_score_correction_bias, torch.zeros(E))
    agree = (chosen[0].sort(-1).values == chosen[1].sort(-1).values).all(-1).float().mean()
    assert agree > 0.99  # the two aggregations place the biases alike (ties aside)


def test_published_histogram_over_two_gloo_ranks_is_within_one_bin_of_the_exact_quantile(two_gloo_ranks):
    biases = two_gloo_ranks["published"]
    assert torch.equal(biases[0], biases[1])
    scores, old = batch()
    exact = published_bias(scores, old, K)  # one process, exact quantile over the union of the two shards
    width = float(old.max() - old.min() + 2) / QB_HISTOGRAM_BINS
    # Both mean-centred: each raw quantile within one bin, so the centred ones within two bin widths.
    assert (biases[0] - exact).abs().max() < 2 * width, (biases[0] - exact).abs().max()
    # and the uncentred histogram quantile lies in the bin of the exact one
    raw_exact = quantile_bias(scores, old, K, center=False)
    shift = (raw_exact - exact).mean()
    assert ((biases[0] + shift) - raw_exact).abs().max() < 2 * width


def test_router_uses_the_published_histogram_when_given_a_reduce():
    from k3.config import ModelConfig
    from k3.layers.moe import Router

    config = ModelConfig.from_preset("debug", num_experts=E, num_experts_per_tok=K)
    router = Router(config)
    router.reduce = lambda tensor, op: tensor
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 0.5)
    x = torch.randn(512, config.hidden_size, generator=generator)
    routing = router(x)
    router.update_bias()
    expected = published_bias_histogram(routing.scores_TE.detach(), torch.zeros(E), K, router.reduce)
    torch.testing.assert_close(router.e_score_correction_bias, expected)
