"""The whole model trains the same through k3's Triton training kernels (AttnRes mix, MoE combine, RMSNorm), run in
Triton's CPU interpreter, as through their PyTorch twins: the loss and every parameter's gradient."""

import os

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig
import k3.ops.norm as norm_ops
from k3.ops.attn_res import set_attn_res_backend
from k3.ops.rms_norm_triton import rms_norm_triton

# The model's CPU tensors reach the kernels only in the interpreter (tests/conftest.py sets it where there is no
# GPU); on a GPU machine the kernels' own tests compile them, and the debug model's fp32 fla kernels would compile
# for minutes (as in tests/train/test_training_step_kernels.py).
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels on CPU tensors in Triton's interpreter")


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


def test_debug_model_step_equals_with_k3s_rms_norm_on_and_off(monkeypatch):
    torch.manual_seed(0)
    config = ModelConfig.from_preset("debug")
    model = K3ForCausalLM(config)
    with torch.no_grad():  # norm weights away from 1, so that dweight and w's part of dx are tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    calls = []
    monkeypatch.setattr(norm_ops, "rms_norm_triton", lambda *a, **k: calls.append(1) or rms_norm_triton(*a, **k))
    monkeypatch.delenv("K3_RMS_NORM", raising=False)
    loss_t, grads_t = loss_and_grads(model, ids)
    assert not calls
    monkeypatch.setenv("K3_RMS_NORM", "triton")
    loss_k, grads_k = loss_and_grads(model, ids)
    assert calls  # every RMSNorm of the model went through the kernels
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-5, atol=1e-6)
    assert grads_k.keys() == grads_t.keys()
    assert any(n.endswith("norm.weight") for n in grads_t)
    for n in grads_t:
        torch.testing.assert_close(grads_k[n], grads_t[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
