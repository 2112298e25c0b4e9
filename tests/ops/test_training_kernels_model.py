"""The whole model trains the same through this round's Triton training kernels (AttnRes mix, MoE combine), run in
Triton's CPU interpreter, as through their PyTorch twins: the loss and every parameter's gradient."""

import torch

from k3 import K3ForCausalLM, ModelConfig
from k3.ops.attn_res import set_attn_res_backend


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_debug_model_step_equals_the_twins(monkeypatch):
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug")
    model = K3ForCausalLM(config)
    with torch.no_grad():  # non-zero pseudo-queries, so the mixes are not uniform means
        for name, p in model.named_parameters():
            if name.endswith("_res.proj.weight") or name.endswith("attn_res.proj.weight"):
                p.normal_(std=0.5)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    runs = {}
    for name, (attn_res, combine) in {"twins": ("eager", "bmm"), "kernels": ("triton", "triton")}.items():
        set_attn_res_backend(attn_res)
        monkeypatch.setenv("K3_MOE_COMBINE", combine)
        try:
            runs[name] = loss_and_grads(model, ids)
        finally:
            set_attn_res_backend(None)
    (loss_t, grads_t), (loss_k, grads_k) = runs["twins"], runs["kernels"]
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    assert grads_k.keys() == grads_t.keys()
    assert any("attn_res" in n or "_res." in n for n in grads_t)  # the mixes' own parameters are in the check
    for n in grads_t:
        torch.testing.assert_close(grads_k[n], grads_t[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
