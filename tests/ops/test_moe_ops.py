"""The grouped-GEMM and gathered-weights expert paths equal the per-expert loop (CPU has torch._grouped_mm too),
gradients included; gate and up as one grouped GEMM over a w13 buffer equal two; the sync-free expert count equals
torch.bincount."""

import pytest
import torch

from k3.ops.moe import count_per_expert, experts_gathered, experts_grouped_mm, experts_loop


@pytest.mark.parametrize("N", [50, 80])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_grouped_and_gathered_equal_loop_with_empty_experts(act, N):
    torch.manual_seed(0)
    E, F, D = 6, 16, 24
    ids = torch.randint(0, E - 2, (N,))
    ids = (ids + (ids >= 1).long()).sort().values  # experts 1 and 5 (one inside, one at the end) get no tokens
    counts = count_per_expert(ids, E)
    x = torch.randn(N, D, dtype=torch.float32, requires_grad=True)
    w1, w3 = (torch.randn(E, F, D, requires_grad=True) for _ in range(2))
    w2 = torch.randn(E, D, F, requires_grad=True)
    outs = []
    for fn, c in ((experts_loop, counts.tolist()), (experts_grouped_mm, counts), (experts_gathered, counts)):
        y = fn(x, c, w1, w3, w2, act, (4.0, 25.0))
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), [x, w1, w3, w2])
        outs.append([y, *grads])
    for other in outs[1:]:
        for a, b in zip(other, outs[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_count_per_expert_equals_bincount():
    ids = torch.randint(0, 9, (4, 3))
    assert torch.equal(count_per_expert(ids, 12), torch.bincount(ids.reshape(-1), minlength=12))


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the bf16 grouped GEMM runs on CUDA")),
])
def test_gate_up_over_a_w13_buffer_equals_two_grouped_gemms(device, dtype, tol):
    """A frozen model's fused w13 [E, 2F, D] buffer (one gate-and-up GEMM) against w1 and w3 apart (two): the
    output and the input's gradient, with experts that get no rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    e, f, d = 8, 64, 32
    counts = torch.tensor([20, 0, 17, 3, 29, 1, 30, 0], device=device)
    n = int(counts.sum())
    x = torch.randn(n, d, device=device, generator=gen, dtype=dtype)
    w1, w3 = (torch.randn(e, f, d, device=device, generator=gen, dtype=dtype) * 0.1 for _ in range(2))
    w2 = torch.randn(e, d, f, device=device, generator=gen, dtype=dtype) * 0.1
    upstream = torch.randn(n, d, device=device, generator=gen, dtype=dtype)

    def run(w13):
        leaf = x.clone().requires_grad_()
        y = experts_grouped_mm(leaf, counts, w1, w3, w2, "situ", (4.0, 25.0), w13)
        return [y, *torch.autograd.grad(y, leaf, upstream)]

    joined, separate = run(torch.cat([w1, w3], dim=1)), run(None)
    for name, a, b in zip(["y", "x"], joined, separate):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
