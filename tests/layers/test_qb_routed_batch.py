"""Quantile Balancing balances the batch it routes (SPEC section 7): the bias used for a training batch's
selection is solved on that batch, iterated to the fixed point, so maxvio of the routed batch itself is near 0
whenever every expert's quota k*T/E is at least 8. One update from the previous bias (the old behaviour) is
not: it leaves maxvio ~0.5 on the same stream."""

import pytest
import torch

from k3.config import ModelConfig
from k3.layers.balancing import QB_MAX_ITERS, balanced_enough, expert_load, maxvio, solve_batch_bias
from k3.layers.moe import Router
from k3.model import K3ForCausalLM

E, K = 16, 2


def drifting_router_stream(tokens: int, qb_iters: int, steps: int = 12) -> list[float]:
    """maxvio of each routed training batch while the router drifts between batches, as in training."""
    config = ModelConfig.from_preset("debug", num_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    router = Router(config).train()
    router.qb_max_iters = qb_iters
    torch.nn.init.normal_(router.weight, std=0.3)
    generator = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        shift = 0.5 * torch.randn(config.hidden_size, generator=generator)  # batches differ in their mean
        x = torch.randn(tokens, config.hidden_size, generator=generator) + shift
        with torch.no_grad():
            router.weight.add_(0.05 * torch.randn(router.weight.shape, generator=generator))
        routing = router(x)
        # The load of the selection that was actually made, not a recomputation.
        assert torch.equal(router.last_load_E, expert_load(routing.topk_ids_TK, E))
        seen.append(router.maxvio())
    return seen


@pytest.mark.parametrize("tokens", [64, 128, 512, 2048])  # quota k*T/E = 8, 16, 64, 256
def test_routed_batch_is_balanced(tokens):
    seen = drifting_router_stream(tokens, qb_iters=64)
    # Exact on every batch measured here; the solver's cap allows one token over in rare batches (at quota 8
    # that is 0.125), which the bound leaves room for.
    assert max(seen) <= 0.13, seen
    assert sum(seen) / len(seen) <= 0.02, seen


def test_one_update_from_the_previous_bias_leaves_the_batch_unbalanced():
    seen = drifting_router_stream(512, qb_iters=1)
    assert sum(seen) / len(seen) > 0.3, seen  # measured 0.38: what the iteration removes


def test_solver_stops_once_balanced_and_reports_its_updates():
    generator = torch.Generator().manual_seed(0)
    scores = torch.sigmoid(torch.randn(1024, E, generator=generator) + torch.linspace(-1.0, 1.5, E))
    bias, used = solve_batch_bias(scores, torch.zeros(E), K, max_iters=200)
    load = expert_load((scores + bias).topk(K, dim=-1).indices, E)
    assert balanced_enough(load, K, 1024) and maxvio(load) == 0.0
    assert 1 < used < 50  # measured 21
    again, used_again = solve_batch_bias(scores, bias, K, max_iters=200)
    assert used_again == 0  # from the solution, the load test passes before any update
    assert abs(float(bias.mean())) < 1e-5


def test_model_training_forward_balances_every_moe_layer():
    config = ModelConfig.from_preset("debug")  # 8 experts, top-2
    torch.manual_seed(0)
    model = K3ForCausalLM(config).train()
    for _, router in model.routers():
        torch.nn.init.normal_(router.weight, std=0.5)  # a router with strong preferences
        router.qb_max_iters = QB_MAX_ITERS  # the iterated rule balances the routed batch itself
    ids = torch.randint(0, config.vocab_size, (1, 256))  # quota 2*256/8 = 64
    model(ids, labels=ids)
    per_layer = model.moe_maxvio()
    assert per_layer and max(per_layer.values()) <= 0.1, per_layer
    model.eval()  # frozen bias at eval time: no update, whatever the balance
    before = [r.e_score_correction_bias.clone() for _, r in model.routers()]
    model(ids)
    assert all(torch.equal(b, r.e_score_correction_bias) for b, (_, r) in zip(before, model.routers()))
