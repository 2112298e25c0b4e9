"""A training step through the CUDA kernels (AttnRes mix, RMSNorm, MoE combine forced to Triton; on CPU in Triton's
interpreter) on packed documents: in fp32 it equals the eager step, and under bf16 autocast, as `k3 train` runs on
a GPU, it runs at all. That second case is the one that broke: autocast leaves the embedding (AttnRes's first
source) in fp32 beside bf16 layer outputs, and the kernels took one dtype."""

from __future__ import annotations

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig

DEVICE = "cpu"
# On a GPU machine the debug model's fp32 fla kernels would compile for minutes, and `k3 train` there runs these
# kernels for real; the interpreter run is what CPU-only CI can check.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in Triton's CPU interpreter")
KERNELS = {"K3_ATTN_RES_BACKEND": "triton", "K3_RMS_NORM": "triton", "K3_MOE_COMBINE": "triton"}


def _step(monkeypatch, kernels: bool, autocast: bool):
    for name, value in KERNELS.items():
        if kernels:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).to(DEVICE).train()
    generator = torch.Generator().manual_seed(1)
    # Two packed documents of 12 and 20 tokens (the interpreted kernels' time grows with the rows).
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=generator).to(DEVICE)
    cu_seqlens = torch.tensor([0, 12, 32], device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, cu_seqlens=cu_seqlens, labels=ids, return_logits=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_fp32_step_through_the_kernels_equals_the_eager_step(monkeypatch):
    want, want_grads = _step(monkeypatch, kernels=False, autocast=False)
    got, got_grads = _step(monkeypatch, kernels=True, autocast=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    worst = max(_relative(got_grads[n], want_grads[n]) for n in want_grads)
    assert worst < 1e-4, worst


def test_autocast_step_through_the_kernels_runs_as_the_trainer_does(monkeypatch):
    want, want_grads = _step(monkeypatch, kernels=False, autocast=True)
    got, got_grads = _step(monkeypatch, kernels=True, autocast=True)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.isfinite(g).all() for g in got_grads.values())
    # bf16 rounds differently in the kernels and the twins, which can flip a token's expert choice, so routed
    # layers may differ a lot; the typical parameter stays at bf16's level.
    errors = sorted(_relative(got_grads[n], want_grads[n]) for n in want_grads)
    assert errors[len(errors) // 2] < 5e-2, errors[len(errors) // 2]
