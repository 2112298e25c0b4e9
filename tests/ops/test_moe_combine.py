"""The MoE combine's Triton kernels (run in Triton's CPU interpreter without a GPU) against an fp64 oracle and the
batched-matmul twin: outputs and both gradients, widths and token counts that are not multiples of the blocks."""

import os

import pytest
import torch

from k3.ops import moe_combine
from k3.ops.moe_combine import combine_pairs_bmm, combine_pairs_sum, combine_pairs_triton, weighted_sum_over_k


# The kernels take CPU tensors only in Triton's interpreter (tests/conftest.py sets it where there is no GPU).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")


def oracle(y_TKL, weights_TK):
    return (y_TKL.double() * weights_TK.double().unsqueeze(-1)).sum(1)


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@interpreted
@pytest.mark.parametrize("tokens,top_k,width", [(1, 1, 16), (13, 6, 40), (37, 3, 130), (9, 8, 600)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_the_oracle(tokens, top_k, width, dtype):
    generator = torch.Generator().manual_seed(tokens * 100 + width)
    y = torch.randn(tokens, top_k, width, generator=generator).to(dtype).requires_grad_(True)
    w = torch.rand(tokens, top_k, generator=generator).requires_grad_(True)  # fp32 gate weights, as routed
    upstream = torch.randn(tokens, width, generator=generator).to(dtype)
    out = combine_pairs_triton(y, w)
    assert out.dtype == dtype and out.shape == (tokens, width)
    grad_y, grad_w = torch.autograd.grad(out, [y, w], upstream)
    assert grad_y.dtype == dtype and grad_w.dtype == torch.float32

    y64, w64 = y.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = oracle(y64, w64)
    want_y, want_w = torch.autograd.grad(want, [y64, w64], upstream.double())
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the output's and dy's own rounding
    assert relative(out, want) < tol
    assert relative(grad_y, want_y) < tol
    assert relative(grad_w, want_w) < 1e-6  # fp32 sums of the given (rounded) inputs


@interpreted
def test_equals_the_bmm_twin_in_fp32():
    y = torch.randn(21, 6, 72, requires_grad=True)
    w = torch.rand(21, 6, requires_grad=True)
    upstream = torch.randn(21, 72)
    results = []
    for fn in (combine_pairs_triton, combine_pairs_bmm):
        out = fn(y, w)
        results.append([out, *torch.autograd.grad(out, [y, w], upstream)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_form_matches_the_oracle_eager_and_compiled(dtype):
    """The product-and-sum combine (K3_MOE_COMBINE=sum, for compiled decode): fp32 sums of the given inputs, the
    same through Inductor, and the bmm twin's result in fp32."""
    generator = torch.Generator().manual_seed(3)
    y = torch.randn(19, 6, 72, generator=generator).to(dtype)
    w = torch.rand(19, 6, generator=generator)
    want = oracle(y, w)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    for fn in (combine_pairs_sum, torch.compile(combine_pairs_sum, fullgraph=True)):
        out = fn(y, w)
        assert out.dtype == dtype and relative(out, want) < tol
    if dtype == torch.float32:
        torch.testing.assert_close(combine_pairs_sum(y, w), combine_pairs_bmm(y, w), rtol=1e-5, atol=1e-5)


@interpreted
def test_every_output_is_written_and_nans_stay_in_their_rows():
    """torch.empty is NaN-filled in tests (conftest): an unwritten element would show. A NaN in one token's pair
    output reaches that token's row and its weight gradients only."""
    y = torch.randn(11, 4, 50)
    y[3, 2, 7] = float("nan")
    w = torch.rand(11, 4)
    yg, wg = y.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = combine_pairs_triton(yg, wg)
    grad_y, grad_w = torch.autograd.grad(out, [yg, wg], torch.ones(11, 50))
    bad_rows = out.isnan().any(1)
    assert bad_rows.tolist() == [t == 3 for t in range(11)]
    assert grad_y.isfinite().all()  # dy = w * g reads no y
    assert grad_w.isnan().nonzero().tolist() == [[3, 2]]


@interpreted
def test_empty_batch():
    y = torch.randn(0, 6, 32, requires_grad=True)
    w = torch.rand(0, 6, requires_grad=True)
    out = combine_pairs_triton(y, w)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert y.grad.shape == y.shape and w.grad.shape == w.shape


@interpreted
def test_switch(monkeypatch):
    y, w = torch.randn(5, 2, 24), torch.rand(5, 2)
    calls = []
    real = moe_combine.combine_pairs_triton
    monkeypatch.setattr(moe_combine, "combine_pairs_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("K3_MOE_COMBINE", "auto")
    weighted_sum_over_k(y, w)  # CPU tensors: auto keeps the twin
    assert calls == []
    monkeypatch.setenv("K3_MOE_COMBINE", "triton")
    torch.testing.assert_close(weighted_sum_over_k(y, w), combine_pairs_bmm(y, w), rtol=1e-5, atol=1e-5)
    assert calls == [1]
    monkeypatch.setenv("K3_MOE_COMBINE", "sum")
    torch.testing.assert_close(weighted_sum_over_k(y, w), combine_pairs_bmm(y, w), rtol=1e-5, atol=1e-5)
    assert calls == [1]
    monkeypatch.setenv("K3_MOE_COMBINE", "einsum")
    with pytest.raises(ValueError, match="K3_MOE_COMBINE='einsum'; use auto, torch, triton or sum"):
        weighted_sum_over_k(y, w)


def test_auto_takes_the_sum_form_in_compiled_inference_only(monkeypatch):
    """auto: the product-and-sum form when torch.compile traces without autograd (a compiled decode step), the bmm
    when it traces a training step, and the bmm eagerly on CPU."""
    taken = []
    for name in ("combine_pairs_sum", "combine_pairs_bmm"):
        real = getattr(moe_combine, name)
        monkeypatch.setattr(moe_combine, name, lambda *a, real=real, name=name: taken.append(name) or real(*a))
    monkeypatch.setenv("K3_MOE_COMBINE", "auto")
    y, w = torch.randn(5, 3, 24), torch.rand(5, 3)
    want = combine_pairs_bmm(y, w)
    compiled = torch.compile(weighted_sum_over_k, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(y, w), want, rtol=1e-5, atol=1e-5)
    assert taken == ["combine_pairs_sum"]
    torch._dynamo.reset()
    taken.clear()
    out = compiled(y.requires_grad_(True), w)
    out.sum().backward()
    assert taken == ["combine_pairs_bmm"]
    taken.clear()
    weighted_sum_over_k(y, w)
    assert taken == ["combine_pairs_bmm"]


@interpreted
def test_latent_moe_trains_the_same_through_the_kernels(monkeypatch):
    """A LatentMoE layer's output and parameter gradients with the combine on the kernels equal the twin's."""
    from k3.config import ModelConfig
    from k3.layers.moe import LatentMoE

    config = ModelConfig.from_preset("debug")
    torch.manual_seed(0)
    layer = LatentMoE(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, config.hidden_size)
    results = []
    for backend in ("bmm", "triton"):
        monkeypatch.setenv("K3_MOE_COMBINE", backend)
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach()] + [p.grad.clone() for p in layer.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1]) > 3
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
