import pytest
import torch

from k3.config import ModelConfig
from k3.layers.balancing import balance_batch, expert_load, loss_free_bias, maxvio, quantile_bias
from k3.layers.moe import Router

T, E, K = 4096, 16, 2
SKEW = torch.linspace(-1.0, 1.5, E)  # a stationary preference: high-index experts are popular


def skewed_scores(tokens: int = T, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(tokens, E, generator=generator) + SKEW)


def load_with(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return expert_load((scores + bias).topk(K, dim=-1).indices, E)


def test_plain_topk_is_far_from_balanced():
    assert maxvio(load_with(skewed_scores(), torch.zeros(E))) > 1.0


def test_one_quantile_update_gives_every_expert_its_quota_against_the_cutoffs():
    # SPEC §7: with c_t the (k+1)-th biased score, expert e receives t iff s_te + b_e > c_t; after one
    # update every expert receives exactly k*T/E tokens of this batch.
    scores = skewed_scores()
    old_bias = torch.randn(E) * 0.05
    new_bias = quantile_bias(scores, old_bias, K, center=False)
    cutoff = (scores + old_bias).topk(K + 1, dim=-1).values[:, -1:]
    received = (scores + new_bias > cutoff).sum(0)
    # Ties aside: the (k+1)-th expert of a token needs exactly its old bias, so equal required biases occur.
    required = (cutoff - scores).sort(dim=0).values
    quota = K * T // E
    untied = required[quota - 1] < required[quota]
    assert untied.sum() >= E - 2
    assert torch.all(received[untied] == quota), received.tolist()


def test_quantile_balancing_fixed_point_is_exact_top_k_balance():
    scores = skewed_scores()
    bias = balance_batch(scores, K)
    load = load_with(scores, bias)
    assert load.sum() == K * T
    assert torch.all(load == K * T // E), load.tolist()
    assert maxvio(load) == 0.0
    assert maxvio(load_with(scores, torch.zeros(E))) > 1.0


def test_quantile_balancing_one_step_per_batch_on_a_stationary_stream():
    bias = torch.zeros(E)
    history = []
    for step in range(12):
        scores = skewed_scores(seed=step)
        history.append(maxvio(load_with(scores, bias)))
        bias = quantile_bias(scores, bias, K)
    assert history[0] > 1.0
    assert max(history[-4:]) < 0.15, history
    assert abs(float(bias.mean())) < 1e-5  # mean-centred


def test_loss_free_sign_update_moves_against_load():
    load = torch.tensor([10.0, 0.0, 5.0, 5.0])
    bias = loss_free_bias(load, torch.zeros(4), gamma=1e-3)
    assert bias.tolist() == pytest.approx([-1e-3, 1e-3, 0.0, 0.0])


def test_router_bias_selects_only_and_freezes_in_eval():
    config = ModelConfig.from_preset("debug", num_experts=E, num_experts_per_tok=K)
    router = Router(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(64, config.hidden_size)
    router.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, E))
    router.eval()
    routing = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    expected = scores.gather(1, routing.topk_ids_TK)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(routing.topk_weights_TK, expected)  # weights from unbiased scores
    before = router.e_score_correction_bias.clone()
    router(x)
    router.update_bias()
    assert torch.equal(router.e_score_correction_bias, before)  # frozen at eval time
    router.train()
    routing = router(x)  # published QB: the batch routes with the bias as it stands...
    assert torch.equal(router.e_score_correction_bias, before)
    router.update_bias()  # ...and the update from its scores applies at the step's end
    assert not torch.equal(router.e_score_correction_bias, before)
    # the same scores under the new bias are better balanced
    assert maxvio(expert_load(router(x).topk_ids_TK, E)) < maxvio(expert_load(routing.topk_ids_TK, E))


def test_router_forward_state_hands_a_forwards_updates_to_another_router():
    """What graphed_step re-points after a replay: the state one training forward leaves, restored on a router
    that ran no forward, gives the same step-end update; drop_pending_updates makes update_bias a no-op."""
    config = ModelConfig.from_preset("debug", num_experts=E, num_experts_per_tok=K)
    ran, restored = Router(config), Router(config)
    torch.nn.init.normal_(ran.weight, std=0.5)
    restored.load_state_dict(ran.state_dict())
    ran.train(), restored.train()
    ran(torch.randn(64, config.hidden_size))
    restored.restore_forward_state(ran.forward_state())
    assert restored.maxvio() == ran.maxvio() and restored.maxvio() > 0
    ran.update_bias(), restored.update_bias()
    assert not torch.equal(ran.e_score_correction_bias, torch.zeros(E))
    torch.testing.assert_close(restored.e_score_correction_bias, ran.e_score_correction_bias, rtol=0, atol=0)
    before = ran.e_score_correction_bias.clone()
    ran(torch.randn(64, config.hidden_size))
    ran.drop_pending_updates()
    ran.update_bias()
    assert torch.equal(ran.e_score_correction_bias, before)
    with pytest.raises(ValueError, match="not a Router forward state"):
        ran.restore_forward_state({"weight": None})
