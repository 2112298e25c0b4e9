"""The skinny-GEMM Triton kernel (k3.ops.linear_triton) against torch.nn.functional.linear."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")

from k3.ops.linear_triton import (SKINNY_MAX_ROWS, SKINNY_MAX_WEIGHT, SKINNY_ROWS_MAX_WEIGHT,  # noqa: E402
                                  skinny_linear_eager, within_auto_bounds)


@interpreted
@pytest.mark.parametrize("rows, out_width, in_width, block_n, block_k", [
    (1, 40, 24, 16, 16),   # widths that are no multiple of the blocks
    (5, 64, 100, 32, 32),  # several K blocks with a ragged tail
    (16, 17, 16, 16, 256),  # BLOCK_K clipped to the row
    (17, 40, 48, 16, 16),  # BLOCK_M 32, half of it past the rows
    (64, 33, 40, 32, 32),  # BLOCK_M 64, full
    (50, 24, 200, None, None),  # past 16 rows: the default blocks for that many rows
])
def test_skinny_equals_linear(rows, out_width, in_width, block_n, block_k):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_width, generator=g)
    w = torch.randn(out_width, in_width, generator=g)
    got = skinny_linear_eager(x, w, block_n, block_k)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


@interpreted
def test_skinny_reads_a_column_slice_of_a_padded_output():
    """x as Inductor lays out a column slice of a GEMM output whose row stride it padded (to 64 elements here):
    the kernel reads it through its strides, so the op is tagged to take any layout without a copy."""
    g = torch.Generator().manual_seed(3)
    padded = torch.randn(2, 5, 64, generator=g)
    x = padded[..., 8:48]
    w = torch.randn(24, 40, generator=g)
    torch.testing.assert_close(skinny_linear_eager(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    assert torch._C.Tag.flexible_layout in torch.ops.k3.skinny_linear.default.tags


@interpreted
def test_skinny_keeps_leading_dims_and_says_what_it_takes():
    x = torch.randn(2, 1, 24)
    w = torch.randn(8, 24)
    assert skinny_linear_eager(x, w).shape == (2, 1, 8)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear_eager(torch.randn(SKINNY_MAX_ROWS + 1, 24), w)
    with pytest.raises(ValueError, match="width 23"):
        skinny_linear_eager(torch.randn(1, 23), w)


@pytest.mark.parametrize("rows, weight_elements, taken", [
    (1, SKINNY_MAX_WEIGHT - 1, True), (1, SKINNY_MAX_WEIGHT, False),  # one token: up to the shared gate+up
    (2, SKINNY_ROWS_MAX_WEIGHT, True), (64, SKINNY_ROWS_MAX_WEIGHT, True),  # o_proj [1024, 1024] at batch 64
    (64, SKINNY_ROWS_MAX_WEIGHT + 1, False), (2, SKINNY_MAX_WEIGHT - 1, False),  # the fused groups lost there
    (65, 1024, False),
])
def test_auto_takes_the_kernel_where_it_was_measured_to_win(rows, weight_elements, taken):
    assert within_auto_bounds(rows, weight_elements) is taken


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_skinny_cuda_bf16(rows):
    x = torch.randn(rows, 1024, device="cuda").bfloat16()
    w = torch.randn(4232, 1024, device="cuda").div_(32).bfloat16()
    want = x.float() @ w.float().t()
    got = skinny_linear_eager(x, w).float()
    assert (got - want).norm() / want.norm() < 1e-2


@interpreted
def test_model_decode_step_through_the_kernel_equals_torch(monkeypatch):
    """A one-token cached decode step of the debug model with every eligible projection on the skinny kernel."""
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM
    from k3.ops import linear_triton

    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    ids = torch.randint(1, 200, (1, 6))
    calls = []
    kernel = linear_triton.skinny_linear_eager
    monkeypatch.setattr(linear_triton, "skinny_linear_eager", lambda *a: calls.append(a[1].shape) or kernel(*a))

    def step(backend):
        monkeypatch.setenv("K3_LINEAR_BACKEND", backend)
        cache = model.new_cache(1)
        with torch.no_grad():
            model(ids[:, :-1], cache=cache)
            return model(ids[:, -1:], cache=cache).logits

    want = step("torch")
    assert not calls
    got = step("triton")
    assert len(calls) >= 3  # projections of the prefill (5 rows) and the decode token went through the kernel
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_project_keeps_hooks_bias_and_autograd_on_the_module(monkeypatch):
    from k3.ops import linear_triton

    monkeypatch.setenv("K3_LINEAR_BACKEND", "triton")
    monkeypatch.setattr(linear_triton, "skinny_linear_eager", lambda *a: pytest.fail("kernel called"))
    x = torch.randn(1, 8)
    with_bias = torch.nn.Linear(8, 4)
    torch.testing.assert_close(linear_triton.project(with_bias, x), with_bias(x))
    plain = torch.nn.Linear(8, 4, bias=False)
    seen = []
    handle = plain.register_forward_hook(lambda module, args, out: seen.append(out))
    linear_triton.project(plain, x)
    handle.remove()
    assert len(seen) == 1
    out = linear_triton.project(plain, x)  # grad enabled and the weight wants one: torch's linear
    assert out.requires_grad
    monkeypatch.setenv("K3_LINEAR_BACKEND", "cublas")
    with pytest.raises(ValueError, match="use auto, torch or triton"):
        with torch.no_grad():
            linear_triton.project(plain, x)
