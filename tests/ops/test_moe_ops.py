"""The grouped-GEMM and gathered-weights expert paths equal the per-expert loop (CPU has torch._grouped_mm too),
gradients included; the sync-free expert count equals torch.bincount."""

import pytest
import torch

from k3.ops.moe import count_per_expert, experts_gathered, experts_grouped_mm, experts_loop


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_grouped_and_gathered_equal_loop_with_empty_experts(act):
    torch.manual_seed(0)
    E, F, D, N = 6, 16, 24, 50
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
