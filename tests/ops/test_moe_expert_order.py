"""The MoE combine read straight from expert order (k3.ops.moe.combine_from_expert_order) and gather_pairs' backward
as one kernel (k3.ops.moe.sum_pairs_per_token), Triton kernels in the CPU interpreter against their twins (the
unpermute + pair-order combine, the gather + sum over K) and an fp64 oracle: outputs and every gradient, routings
from a real top-k with empty experts, K 1, 2 and 6, widths 40 (not a power of two), 64 and 600 (more than one
column block), token counts that are no multiple of a tile; the K3_MOE_COMBINE switch; and a LatentMoE layer that
trains the same through the kernels as through the twins."""

from __future__ import annotations

import os

import pytest
import torch

import k3.ops.moe as moe_ops
from k3.ops.moe import (combine_from_expert_order, combine_from_expert_order_twin, gather_pairs,
                        sort_pairs_by_expert, sum_pairs_per_token, sum_pairs_per_token_twin)
from k3.ops.moe_combine import combine_from_expert_order_triton, sum_pairs_from_expert_order_triton

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")

NUM_EXPERTS = 16
UNUSED_EXPERTS = 3  # the last experts score lowest for every token: they get no pairs
# (tokens, top_k, width): token counts past one 16-token tile and no multiple of it.
CASES = [(37, 1, 40), (37, 2, 64), (21, 6, 40), (19, 6, 64), (5, 2, 600)]


def sorted_routing(num_tokens: int, top_k: int, seed: int):
    """(order_N, inverse_N) of a sigmoid-router top-k over NUM_EXPERTS, the last UNUSED_EXPERTS never chosen."""
    gen = torch.Generator().manual_seed(seed)
    scores_TE = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
    scores_TE[:, -UNUSED_EXPERTS:] = -1.0
    ids_N = scores_TE.topk(top_k, dim=-1).indices.reshape(-1)
    order_N, inverse_N, counts_E = sort_pairs_by_expert(ids_N, NUM_EXPERTS)
    assert (counts_E == 0).sum() >= UNUSED_EXPERTS
    return order_N, inverse_N


def relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_bf16_as_close_as_the_twin(got, twin, exact, name: str = "") -> None:
    """A bf16 result of fp32 sums: every element within one bf16 step of the fp64 result, and in norm within
    2.5x the twin's own distance from it. Triton's CPU interpreter truncates fp32 to bf16 (the GPU rounds to
    nearest), which alone doubles the rounding error's norm; tests/ops/test_moe_expert_order.py runs there."""
    _, exponent = torch.frexp(exact)
    bf16_step = torch.ldexp(torch.ones_like(exact), exponent - 8)
    assert ((got.double() - exact).abs() <= bf16_step * (1 + 1e-6)).all(), name
    mine, theirs = relative(got, exact), relative(twin, exact)
    assert mine <= 2.5 * theirs + 1e-6 and mine < 8e-3, f"{name}: {mine:.2e} from fp64, the twin {theirs:.2e}"


def combine_oracle(y_NL, inverse_N, weights_TK):
    """fp64 sums of the given inputs, through plain indexing (autograd's own backward)."""
    num_tokens, top_k = weights_TK.shape
    return (y_NL.double()[inverse_N].view(num_tokens, top_k, -1) * weights_TK.double().unsqueeze(-1)).sum(1)


def combine_with_grads(fn, y_NL, inverse_N, weights_TK, upstream_TL, *extra):
    y_NL, weights_TK = y_NL.detach().requires_grad_(True), weights_TK.detach().requires_grad_(True)
    out = fn(y_NL, inverse_N, weights_TK, *extra)
    return [out, *torch.autograd.grad(out, [y_NL, weights_TK], upstream_TL)]


def combine_inputs(num_tokens, top_k, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    y_NL = torch.randn(num_tokens * top_k, width, generator=gen).to(dtype)
    weights_TK = torch.rand(num_tokens, top_k, generator=gen)  # fp32 gate weights, as routed
    upstream_TL = torch.randn(num_tokens, width, generator=gen).to(dtype)
    return y_NL, weights_TK, upstream_TL


@interpreted
@pytest.mark.parametrize("num_tokens,top_k,width", CASES)
def test_combine_from_expert_order_equals_the_twin_in_fp32(num_tokens, top_k, width):
    order_N, inverse_N = sorted_routing(num_tokens, top_k, seed=num_tokens + width)
    y_NL, weights_TK, upstream_TL = combine_inputs(num_tokens, top_k, width, torch.float32, seed=top_k)
    got = combine_with_grads(combine_from_expert_order_triton, y_NL, inverse_N, weights_TK, upstream_TL)
    want = combine_with_grads(combine_from_expert_order_twin, y_NL, inverse_N, weights_TK, upstream_TL, order_N)
    assert got[0].shape == (num_tokens, width) and got[1].shape == y_NL.shape and got[2].dtype == torch.float32
    for name, a, b in zip(("out", "dy", "dw"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@interpreted
@pytest.mark.parametrize("num_tokens,top_k,width", CASES)
def test_combine_from_expert_order_in_bf16_is_as_close_to_fp64_as_the_twin(num_tokens, top_k, width):
    """bf16 rows, fp32 gate weights: the kernels' output and dy are rounded once from fp32 sums (the twin rounds
    the weights to bf16 first), dw is an fp32 sum of the given inputs (the twin's is rounded to bf16)."""
    order_N, inverse_N = sorted_routing(num_tokens, top_k, seed=num_tokens + width)
    y_NL, weights_TK, upstream_TL = combine_inputs(num_tokens, top_k, width, torch.bfloat16, seed=top_k)
    got = combine_with_grads(combine_from_expert_order_triton, y_NL, inverse_N, weights_TK, upstream_TL)
    twin = combine_with_grads(combine_from_expert_order_twin, y_NL, inverse_N, weights_TK, upstream_TL, order_N)
    assert got[0].dtype == got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    exact = combine_with_grads(combine_oracle, y_NL.double(), inverse_N, weights_TK.double(), upstream_TL.double())
    for name, a, t, x in zip(("out", "dy"), got, twin, exact):
        assert_bf16_as_close_as_the_twin(a, t, x, name)
    assert relative(got[2], exact[2]) < 1e-6


@interpreted
@pytest.mark.parametrize("num_tokens,top_k,width", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_pairs_backward_kernel_equals_the_gather_and_sum(num_tokens, top_k, width, dtype):
    order_N, inverse_N = sorted_routing(num_tokens, top_k, seed=7 * num_tokens + top_k)
    grad_NL = torch.randn(num_tokens * top_k, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    got = sum_pairs_from_expert_order_triton(grad_NL, inverse_N, top_k)
    twin = sum_pairs_per_token_twin(grad_NL, inverse_N, num_tokens, top_k)
    assert got.dtype == dtype and got.shape == (num_tokens, width)
    if dtype == torch.float32:
        torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_as_close_as_the_twin(got, twin, grad_NL.double()[inverse_N].view(num_tokens, top_k, width).sum(1))


@interpreted
def test_gather_pairs_backward_runs_the_kernel_when_switched_to_triton(monkeypatch):
    """Through autograd: gather_pairs' backward takes the kernel under K3_MOE_COMBINE=triton, the twin under bmm,
    and both give plain indexing's gradient."""
    calls = []
    real = moe_ops.sum_pairs_from_expert_order_triton
    monkeypatch.setattr(moe_ops, "sum_pairs_from_expert_order_triton", lambda *a: calls.append(1) or real(*a))
    order_N, inverse_N = sorted_routing(23, 6, seed=3)
    h_TL = torch.randn(23, 40)
    upstream_NL = torch.randn(23 * 6, 40)
    want = torch.autograd.grad(h_TL.requires_grad_(True)[order_N // 6], h_TL, upstream_NL)[0]
    for backend, kernel_calls in (("triton", [1]), ("bmm", [])):
        monkeypatch.setenv("K3_MOE_COMBINE", backend)
        calls.clear()
        got = torch.autograd.grad(gather_pairs(h_TL, order_N, 6, inverse_N), h_TL, upstream_NL)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert calls == kernel_calls, backend


def nan_filled(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor


@interpreted
def test_every_output_element_is_written(monkeypatch):
    """The launchers allocate with empty_like / new_empty, which tests/conftest.py does not NaN-fill: filled here,
    so a row or element the kernels skip shows as NaN."""
    order_N, inverse_N = sorted_routing(19, 6, seed=5)
    y_NL, weights_TK, upstream_TL = combine_inputs(19, 6, 40, torch.float32, seed=5)
    real_empty_like, real_new_empty = torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_filled(real_empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: nan_filled(real_new_empty(self, *a, **k)))
    assert torch.empty_like(torch.zeros(2)).isnan().all() and torch.zeros(1).new_empty(3).isnan().all()
    out, grad_y, grad_w = combine_with_grads(combine_from_expert_order_triton, y_NL, inverse_N, weights_TK,
                                             upstream_TL)
    summed = sum_pairs_from_expert_order_triton(y_NL, inverse_N, 6)
    for tensor in (out, grad_y, grad_w, summed):
        assert tensor.isfinite().all()


@interpreted
def test_empty_batch():
    y_NL = torch.randn(0, 32, requires_grad=True)
    weights_TK = torch.rand(0, 6, requires_grad=True)
    inverse_N = torch.zeros(0, dtype=torch.int64)
    out = combine_from_expert_order_triton(y_NL, inverse_N, weights_TK)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert y_NL.grad.shape == y_NL.shape and weights_TK.grad.shape == weights_TK.shape
    assert sum_pairs_from_expert_order_triton(y_NL.detach(), inverse_N, 6).shape == (0, 32)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="N = tokens \\* top_k = 4 \\* 2"):
        combine_from_expert_order_triton(torch.randn(7, 8), torch.arange(7), torch.rand(4, 2))


@interpreted
def test_switch(monkeypatch):
    """auto keeps the twins for CPU tensors, triton forces the kernels, bmm and sum take the twin; all agree. A bad
    value raises, for both ops."""
    taken = []
    for name in ("combine_from_expert_order_triton", "combine_from_expert_order_twin",
                 "sum_pairs_from_expert_order_triton", "sum_pairs_per_token_twin"):
        real = getattr(moe_ops, name)
        monkeypatch.setattr(moe_ops, name, lambda *a, real=real, name=name: taken.append(name) or real(*a))
    order_N, inverse_N = sorted_routing(9, 2, seed=1)
    y_NL, weights_TK, _ = combine_inputs(9, 2, 24, torch.float32, seed=1)
    results = {}
    for backend in ("auto", "triton", "bmm", "sum"):
        monkeypatch.setenv("K3_MOE_COMBINE", backend)
        taken.clear()
        results[backend] = (combine_from_expert_order(y_NL, inverse_N, weights_TK, order_N),
                            sum_pairs_per_token(y_NL, inverse_N, 9, 2))
        kind = "triton" if backend == "triton" else "twin"
        assert [name.rsplit("_", 1)[-1] for name in taken] == [kind, kind], backend
    for backend in ("triton", "bmm", "sum"):
        for got, want in zip(results[backend], results["auto"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=backend)
    monkeypatch.setenv("K3_MOE_COMBINE", "einsum")
    with pytest.raises(ValueError, match="K3_MOE_COMBINE='einsum'; use auto, torch, triton or sum"):
        combine_from_expert_order(y_NL, inverse_N, weights_TK)
    with pytest.raises(ValueError, match="K3_MOE_COMBINE='einsum'; use auto, torch, triton or sum"):
        sum_pairs_per_token(y_NL, inverse_N, 9, 2)


def test_twin_without_the_order_computes_it():
    order_N, inverse_N = sorted_routing(11, 6, seed=2)
    y_NL, weights_TK, upstream_TL = combine_inputs(11, 6, 24, torch.float32, seed=2)
    with_order = combine_with_grads(combine_from_expert_order_twin, y_NL, inverse_N, weights_TK, upstream_TL, order_N)
    without = combine_with_grads(combine_from_expert_order_twin, y_NL, inverse_N, weights_TK, upstream_TL)
    for a, b in zip(with_order, without):
        assert torch.equal(a, b)


def test_an_auto_chosen_kernel_that_cannot_compile_falls_back_to_the_twin(monkeypatch):
    class CompilationError(Exception):
        pass

    def failing(*args):
        raise CompilationError("out of resource")

    monkeypatch.setattr(moe_ops, "auto_takes_triton", lambda x: True)
    monkeypatch.setattr(moe_ops, "combine_from_expert_order_triton", failing)
    monkeypatch.setattr(moe_ops, "sum_pairs_from_expert_order_triton", failing)
    monkeypatch.setattr("k3.ops.fused_backend._failed", {})
    monkeypatch.setenv("K3_MOE_COMBINE", "auto")
    order_N, inverse_N = sorted_routing(9, 2, seed=4)
    y_NL, weights_TK, _ = combine_inputs(9, 2, 24, torch.float32, seed=4)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        got = combine_from_expert_order(y_NL, inverse_N, weights_TK, order_N)
    torch.testing.assert_close(got, combine_from_expert_order_twin(y_NL, inverse_N, weights_TK, order_N))
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        got = sum_pairs_per_token(y_NL, inverse_N, 9, 2)
    torch.testing.assert_close(got, sum_pairs_per_token_twin(y_NL, inverse_N, 9, 2))


def test_double_backward_of_gather_pairs_keeps_the_twin(monkeypatch):
    """The kernel has no backward of its own: with create_graph the twin runs, even when triton is forced."""
    monkeypatch.setenv("K3_MOE_COMBINE", "triton")
    monkeypatch.setattr(moe_ops, "sum_pairs_from_expert_order_triton", lambda *a: pytest.fail("kernel ran"))
    order_N, inverse_N = sorted_routing(5, 2, seed=6)
    h_TL = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda h: gather_pairs(h, order_N, 2, inverse_N), (h_TL,))


def latent_moe():
    from k3.config import ModelConfig
    from k3.layers.moe import LatentMoE

    torch.manual_seed(0)
    layer = LatentMoE(ModelConfig.from_preset("debug"))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer.train()


@interpreted
def test_latent_moe_trains_the_same_through_the_expert_order_kernels(monkeypatch):
    """A training LatentMoE (debug preset: 8 experts, top-2, latent 32) on CPU takes the sorted path (the
    pair-order kernels run only for CUDA inference, or forced); with K3_MOE_COMBINE=triton its combine reads
    expert order and gather_pairs' backward is the kernel, with bmm both are the twins. Same output, input gradient
    and parameter gradients."""
    monkeypatch.setenv("K3_MOE_BACKEND", "auto")
    taken = []
    for name in ("combine_from_expert_order_triton", "combine_from_expert_order_twin",
                 "sum_pairs_from_expert_order_triton", "sum_pairs_per_token_twin"):
        real = getattr(moe_ops, name)
        monkeypatch.setattr(moe_ops, name, lambda *a, real=real, name=name: taken.append(name) or real(*a))
    monkeypatch.setattr(moe_ops, "experts_by_ids", lambda *a: pytest.fail("the pair-order kernels ran"))
    layer = latent_moe()
    x = torch.randn(2, 11, layer.routed_expert_down_proj.in_features)
    results = {}
    for backend in ("bmm", "triton"):
        monkeypatch.setenv("K3_MOE_COMBINE", backend)
        layer.zero_grad(set_to_none=True)
        taken.clear()
        x_in = x.clone().requires_grad_(True)
        out = layer(x_in)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results[backend] = [out.detach(), x_in.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
        kind = "triton" if backend == "triton" else "twin"
        assert sorted(taken) == sorted([f"combine_from_expert_order_{kind}",
                                        "sum_pairs_from_expert_order_triton" if kind == "triton"
                                        else "sum_pairs_per_token_twin"]), backend
    assert len(results["bmm"]) == len(results["triton"]) > 4
    for got, want in zip(results["triton"], results["bmm"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_latent_moe_pair_order_path_keeps_the_pair_order_combine(monkeypatch):
    """Few pairs with the pair-order kernels (K3_MOE_BACKEND=triton, inference): rows come in pair order and go
    through the pair-order combine, not the expert-order one; same output as the sorted loop path."""
    layer = latent_moe().eval()
    x = torch.randn(1, 3, layer.routed_expert_down_proj.in_features)
    monkeypatch.setenv("K3_MOE_COMBINE", "triton")
    with torch.no_grad():
        monkeypatch.setenv("K3_MOE_BACKEND", "loop")
        want = layer(x)
        monkeypatch.setattr("k3.layers.moe.combine_from_expert_order",
                            lambda *a: pytest.fail("expert-order combine"))
        monkeypatch.setenv("K3_MOE_BACKEND", "triton")
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
