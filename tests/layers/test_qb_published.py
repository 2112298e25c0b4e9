"""Quantile Balancing as published (SPEC section 7): one update per training forward from the batch's scores,
applied from the next step on. Checked against a hand computation and through the Router."""

from __future__ import annotations

import torch

from k3.config import ModelConfig
from k3.layers.balancing import QB_PUBLISHED, published_bias, published_bias_histogram
from k3.layers.moe import Router

# 6 tokens, 3 experts, top-1: q = k*T/E = 2 tokens per expert.
SCORES = torch.tensor([[0.9, 0.5, 0.2],
                       [0.8, 0.7, 0.1],
                       [0.6, 0.3, 0.5],
                       [0.2, 0.9, 0.6],
                       [0.1, 0.4, 0.8],
                       [0.5, 0.2, 0.9]])
BIAS = torch.tensor([0.1, 0.0, -0.1])


def test_published_update_equals_a_hand_computation():
    # biased = s + b; the cutoff is each token's 2nd largest biased score:
    #   [1.0 .5 .1] -> .5, [.9 .7 .0] -> .7, [.7 .3 .4] -> .4, [.3 .9 .5] -> .5, [.2 .4 .7] -> .4, [.6 .2 .8] -> .6
    # r = cutoff - s, per expert sorted:
    #   e0: -.4 -.2 | -.1 .1 .3 .3   2nd smallest -.2, next above it -.1  -> -.15
    #   e1: -.4  0 | 0 0 .1 .4       2nd smallest 0, next above it .1     ->  .05
    #   e2: -.4 -.3 | -.1 -.1 .3 .6  2nd smallest -.3, next above it -.1  -> -.2
    # mean-centred (mean -.1): [-.05, .15, -.1]
    got = published_bias(SCORES, BIAS, top_k=1)
    torch.testing.assert_close(got, torch.tensor([-0.05, 0.15, -0.1]), rtol=0, atol=1e-6)


def test_published_update_takes_the_routings_own_top_k_plus_one():
    top = (SCORES + BIAS).topk(2, dim=-1)
    torch.testing.assert_close(published_bias(SCORES, BIAS, 1, top=top), published_bias(SCORES, BIAS, 1))


def test_histogram_on_one_rank_is_within_one_bin_of_the_exact_quantile():
    generator = torch.Generator().manual_seed(0)
    scores = torch.sigmoid(torch.randn(4096, 16, generator=generator) + torch.linspace(-1.0, 1.5, 16))
    bias = torch.randn(16, generator=generator) * 0.05
    exact = published_bias(scores, bias, 2)
    bins = 1000
    histogram = published_bias_histogram(scores, bias, 2, lambda tensor, op: tensor, bins=bins)
    width = float(bias.max() - bias.min() + 2) / bins
    # both are mean-centred: the raw quantiles differ by < 1 bin each, their means by < 1 bin
    assert (histogram - exact).abs().max() < 2 * width
    assert (histogram - exact).abs().max() > 0  # a histogram, not the exact sort


def router_pair(balancing: str = "quantile") -> Router:
    config = ModelConfig.from_preset("debug", num_experts=8, num_experts_per_tok=2, moe_balancing=balancing)
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    return router


def test_router_routes_with_the_old_bias_and_applies_the_update_at_the_step_end():
    router = router_pair()
    assert router.qb_max_iters == QB_PUBLISHED  # the default rule
    router.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    old = router.e_score_correction_bias.clone()
    x = torch.randn(64, router.weight.shape[1], generator=torch.Generator().manual_seed(1))
    routing = router(x)
    assert torch.equal(router.e_score_correction_bias, old)  # the forward leaves the bias alone
    expected_ids = (routing.scores_TE + old).topk(2, dim=-1).indices
    assert torch.equal(routing.topk_ids_TK.sort(-1).values, expected_ids.sort(-1).values)
    router.update_bias()
    torch.testing.assert_close(router.e_score_correction_bias,
                               published_bias(routing.scores_TE.detach(), old, 2))
    assert router.last_qb_iters == 1


def test_router_in_eval_mode_leaves_the_bias_frozen():
    router = router_pair()
    router.eval()
    old = router.e_score_correction_bias.clone()
    router(torch.randn(64, router.weight.shape[1]))
    router.update_bias()
    assert torch.equal(router.e_score_correction_bias, old)


def test_published_rule_balances_a_stationary_stream():
    # Scores from a fixed router on fresh batches of one distribution: the bias carried from the last batch
    # brings maxvio from 2.9 (unbalanced) to 0.25-0.5 within a few steps: what is left is batch-to-batch noise
    # and the simultaneous move of all biases (the routed batch is not balanced exactly; the iterated rule is).
    router = router_pair()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.add_(torch.linspace(-1, 1, 8)[:, None] * 0.1)  # with inputs of mean 1: skewed scores
    seen = []
    for _ in range(12):
        router(torch.randn(1024, router.weight.shape[1], generator=generator) + 1.0)
        seen.append(router.maxvio())
        router.update_bias()
    assert seen[0] > 2.0, seen
    assert max(seen[4:]) < 0.6 and sum(seen[4:]) / len(seen[4:]) < 0.45, seen


def test_pooling_over_ranks_equals_one_process_exactly():
    # Two ranks' halves of a batch, their required biases gathered (Router.gather): the one-process update.
    generator = torch.Generator().manual_seed(4)
    scores = torch.sigmoid(torch.randn(512, 16, generator=generator))
    bias = torch.randn(16, generator=generator) * 0.05
    halves = scores.chunk(2)
    from k3.layers.balancing import required_bias

    gathered = torch.cat([required_bias(h, bias, 2) for h in halves])
    pooled = published_bias(halves[0], bias, 2, gather=lambda required: gathered)
    assert torch.equal(pooled, published_bias(scores, bias, 2))


def test_the_update_moves_with_the_bias_by_float_noise_only():
    """Expert 0 wins two tokens and is the runner-up (the (k+1)-th) of five: its 4th smallest r is among the
    runner-ups', which is its bias b exactly. Computed as (s + b) - s it was b rounded to the grid of each s (two
    grids here: s below and above 0.5), so the last bits of b (or of s, another batch layout's rounding) decided
    whether the runner-ups tied, and a tie moved the update past them by half a gap (3e-2 here; 6e-4 in a 2-rank
    training run against one process)."""
    scores = torch.tensor([[0.9, 0.2, 0.1]] * 2 + [[0.3, 0.6, 0.1], [0.35, 0.65, 0.1], [0.4, 0.7, 0.1],
                                                   [0.55, 0.9, 0.1], [0.6, 0.95, 0.1]] + [[0.1, 0.2, 0.8]] * 5)
    base = torch.tensor([0.0123457, 0.0, -0.0123457])
    updates = []
    for i in range(32):  # the bias moved by 0 to 3.1e-7, ~10 ulps of b at a time
        bias = base + torch.tensor([i * 1e-8, 0.0, 0.0])
        updates.append(published_bias(scores, bias, top_k=1))
    for update in updates[1:]:
        torch.testing.assert_close(update, updates[0], rtol=0, atol=1e-6)


def test_the_runner_ups_required_bias_is_its_bias_exactly():
    from k3.layers.balancing import required_bias

    generator = torch.Generator().manual_seed(0)
    scores, bias = torch.rand(256, 8, generator=generator), torch.randn(8, generator=generator) * 1e-2
    runner_up = (scores + bias).topk(3, dim=-1).indices[:, 2:]
    assert torch.equal(required_bias(scores, bias, top_k=2).gather(1, runner_up), bias[runner_up])
