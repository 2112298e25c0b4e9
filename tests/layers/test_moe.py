"""LatentMoE against a token-by-token oracle: every token runs its K chosen experts one at a time, in fp64.
Also the pieces of the deterministic combine."""

from __future__ import annotations

import pytest
import torch

from k3.config import ModelConfig
from k3.ops.glu import glu_activation
from k3.layers.moe import LatentMoE, unpermute, weighted_sum_over_k


def oracle_routed(moe: LatentMoE, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor):
    h_TL = x_TD @ moe.routed_expert_down_proj.weight.t() if moe.latent else x_TD
    out = torch.zeros_like(h_TL)
    for t in range(x_TD.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            hidden = glu_activation(moe.w1[e] @ h_TL[t], moe.w3[e] @ h_TL[t], moe.act, *moe.betas)
            out[t] += weights_TK[t, k] * (moe.w2[e] @ hidden)
    if moe.latent:
        if moe.routed_expert_norm is not None:
            out = moe.routed_expert_norm(out)
        out = out @ moe.routed_expert_up_proj.weight.t()
    return out


@pytest.mark.parametrize("latent", [32, None])
def test_routed_path_equals_the_token_by_token_oracle(latent):
    torch.manual_seed(0)
    moe = LatentMoE(ModelConfig.from_preset("debug", moe_latent_size=latent)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.eval()
    x_TD = torch.randn(37, 64, dtype=torch.float64)
    routing = moe.gate(x_TD)
    assert routing.topk_ids_TK.shape == (37, 2)
    got = moe.routed(x_TD, routing)
    want = oracle_routed(moe, x_TD, routing.topk_ids_TK, routing.topk_weights_TK)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("latent", [32, None])
def test_no_tokens_give_an_empty_output(latent):
    """A forward over zero tokens (an empty batch, a rank with no tokens) returns [B, 0, D], it does not raise."""
    moe = LatentMoE(ModelConfig.from_preset("debug", moe_latent_size=latent))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        assert moe.eval()(torch.zeros(1, 0, 64)).shape == (1, 0, 64)


def test_combine_helpers():
    torch.manual_seed(1)
    order = torch.randperm(12)
    y = torch.randn(12, 5, dtype=torch.float64)
    assert torch.equal(unpermute(y[order], order), y)
    y_TKL, w_TK = torch.randn(4, 3, 5, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64)
    torch.testing.assert_close(weighted_sum_over_k(y_TKL, w_TK), (y_TKL * w_TK[..., None]).sum(1))
