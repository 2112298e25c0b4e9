"""The compiled GLU activation (K3_GLU_BACKEND=compiled; training on CUDA before k3.ops.glu_triton) against its PyTorch twin, run here through Inductor on the CPU:
same outputs and gradients, strided gate/up halves of one GEMM output included, and one graph for any row count."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from k3.ops import glu
from k3.ops.glu import compiled_glu, glu_activation, glu_formula


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def halves(rows: int, width: int, seed: int):
    """gate and up as the strided halves of one [rows, 2 * width] tensor, as a fused gate/up GEMM gives them."""
    torch.manual_seed(seed)
    both = (torch.randn(rows, 2 * width) * 6).requires_grad_(True)  # wide enough to reach the tanh caps
    gate, up = both.chunk(2, dim=-1)
    return both, gate, up


@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_compiled_glu_equals_the_formula_in_outputs_and_gradients(kind):
    for rows in (37, 300):
        both, gate, up = halves(rows, 48, seed=rows)
        grad_out = torch.randn(rows, 48)
        twin = glu_formula(gate, up, kind, 4.0, 25.0)
        (twin_grad,) = torch.autograd.grad(twin, both, grad_out)
        fast = compiled_glu()(gate, up, kind, 4.0, 25.0)
        (fast_grad,) = torch.autograd.grad(fast, both, grad_out)
        assert rel(fast, twin) < 1e-6
        assert rel(fast_grad, twin_grad) < 1e-6


def test_one_graph_serves_every_row_count():
    counter = torch._dynamo.testing.CompileCounter()
    glu = torch.compile(glu_formula, dynamic=True, backend=counter)
    for rows in (5, 17, 64, 1000):
        _, gate, up = halves(rows, 16, seed=rows)
        glu(gate, up, "situ", 4.0, 25.0).sum().backward()
    assert counter.frame_count == 1


def test_dispatch_keeps_the_formula_off_cuda_and_rejects_unknown_kinds():
    _, gate, up = halves(8, 16, seed=0)
    assert glu.glu_path(gate, up) == "formula"  # CPU: the twin, bit for bit
    assert torch.equal(glu_activation(gate, up, "situ"), glu_formula(gate, up, "situ"))
    with pytest.raises(ValueError, match="use 'silu' or 'situ'"):
        glu_activation(gate, up, "gelu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled path runs for CUDA tensors")
def test_training_on_cuda_takes_the_compiled_glu_when_asked_and_matches_fp32(monkeypatch):
    monkeypatch.setenv("K3_GLU_BACKEND", "compiled")  # auto takes k3.ops.glu_triton (tests/ops/test_glu_triton.py)
    both, gate, up = halves(4096, 256, seed=1)
    both_cuda = both.detach().cuda().bfloat16().requires_grad_(True)
    g, u = both_cuda.chunk(2, dim=-1)
    assert glu.glu_path(g, u) == "compiled"
    fast = glu_activation(g, u, "situ")
    reference = glu_formula(gate, up, "situ")
    assert rel(fast.float().cpu(), reference) < 1e-2
    grad_out = torch.randn(4096, 256)
    (fast_grad,) = torch.autograd.grad(fast, both_cuda, grad_out.cuda().bfloat16())
    (ref_grad,) = torch.autograd.grad(reference, both, grad_out)
    assert rel(fast_grad.float().cpu(), ref_grad) < 2e-2
