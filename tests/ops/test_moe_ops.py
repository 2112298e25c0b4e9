"""The grouped-GEMM and gathered-weights expert paths equal the per-expert loop (CPU has torch._grouped_mm too),
gradients included, with gate and up as two grouped GEMMs and as one over w1 and w3 concatenated; the sync-free
expert count equals torch.bincount."""

import pytest
import torch

import k3.ops.moe as moe_ops
from k3.ops.moe import (GATE_UP_CONCAT_MIN_ROWS, concatenates_gate_and_up, count_per_expert, experts_gathered,
                        experts_grouped_mm, experts_loop)


# 50 rows take two gate/up GEMMs in the grouped path, 80 one over the concatenated weights.
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


def test_gate_and_up_concatenate_only_in_training_over_many_rows():
    assert concatenates_gate_and_up(GATE_UP_CONCAT_MIN_ROWS, training=True)
    assert concatenates_gate_and_up(16384 * 6, training=True)
    assert not concatenates_gate_and_up(GATE_UP_CONCAT_MIN_ROWS - 1, training=True)
    # Inference reads each expert's weights once instead of copying them, at any batch (decode at batch 64:
    # 384 routed rows).
    assert not concatenates_gate_and_up(64 * 6, training=False)
    assert not concatenates_gate_and_up(16384 * 6, training=False)


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the bf16 grouped GEMM runs on CUDA")),
])
def test_concatenated_gate_up_equals_two_grouped_gemms(monkeypatch, device, dtype, tol):
    """Forward and the gradients of x, w1, w3, w2: one GEMM over cat([w1, w3]) against two (the row threshold
    patched out of reach), with experts that get no rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    e, f, d = 8, 64, 32
    counts = torch.tensor([20, 0, 17, 3, 29, 1, 30, 0], device=device)
    n = int(counts.sum())
    assert concatenates_gate_and_up(n, training=True)
    x = torch.randn(n, d, device=device, generator=gen, dtype=dtype)
    w1, w3 = (torch.randn(e, f, d, device=device, generator=gen, dtype=dtype) * 0.1 for _ in range(2))
    w2 = torch.randn(e, d, f, device=device, generator=gen, dtype=dtype) * 0.1
    upstream = torch.randn(n, d, device=device, generator=gen, dtype=dtype)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w3, w2)]
        y = experts_grouped_mm(leaves[0], counts, *leaves[1:], "situ", (4.0, 25.0))
        return [y, *torch.autograd.grad(y, leaves, upstream)]

    concatenated = run()
    with monkeypatch.context() as patch:
        patch.setattr(moe_ops, "GATE_UP_CONCAT_MIN_ROWS", n + 1)
        separate = run()
    for name, a, b in zip(["y", "x", "w1", "w3", "w2"], concatenated, separate):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
