"""k3.ops.router_logits: the bf16-GEMM router logits against the plain fp32 form (its twin)."""

import pytest
import torch

from k3.ops.router_logits import bf16_gemms_apply, plain_logits, router_logits


def operands(device, tokens=96, dim=80, experts=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g).bfloat16().to(device).requires_grad_()
    w = (0.1 * torch.randn(experts, dim, generator=g)).bfloat16().to(device).requires_grad_()
    return x, w


def grads(logits_fn, x, w, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = logits_fn(x, w)
    upstream = torch.randn(logits.shape, generator=g).to(logits.device)
    gx, gw = torch.autograd.grad((logits * upstream).sum(), (x, w))
    return logits.detach(), gx, gw


def relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_against_plain(device, emulate):
    x, w = operands(device)
    fast, gx, gw = grads(lambda a, b: router_logits(a, b, emulate=emulate), x, w)
    ref, rx, rw = grads(plain_logits, x, w)
    assert fast.dtype == torch.float32 and fast.shape == (96, 12)
    # Products of bf16 values are exact in fp32: only the order of the fp32 sum may differ.
    torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    # Backward rounds dlogits to bf16 once; both gradients end in bf16 on either path.
    assert relative(gx, rx) < 1e-2
    assert relative(gw, rw) < 1e-2


def test_emulated_path_matches_the_plain_form_on_cpu():
    check_against_plain("cpu", emulate=True)


def test_auto_stays_plain_on_cpu_and_for_fp32_weights(monkeypatch):
    x, w = operands("cpu")
    assert not bf16_gemms_apply(x, w)
    assert "RouterLogitsBF16" not in router_logits(x, w).grad_fn.name()
    assert "RouterLogitsBF16" in router_logits(x, w, emulate=True).grad_fn.name()
    monkeypatch.setenv("K3_ROUTER_LOGITS", "fp32")
    assert not bf16_gemms_apply(x, w.float())


def test_bad_switch_value_raises(monkeypatch):
    monkeypatch.setenv("K3_ROUTER_LOGITS", "tf32")
    x, w = operands("cpu")
    with pytest.raises(ValueError, match="K3_ROUTER_LOGITS"):
        router_logits(x, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 GEMMs with fp32 output run on CUDA")
def test_cuda_path_matches_the_plain_form(monkeypatch):
    x, _ = operands("cuda")
    assert bf16_gemms_apply(x, x[:4])
    check_against_plain("cuda", emulate=False)
    monkeypatch.setenv("K3_ROUTER_LOGITS", "fp32")
    assert not bf16_gemms_apply(x, x[:4])
