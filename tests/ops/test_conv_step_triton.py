"""One decode token of the short conv with its window advanced in place (k3.ops.conv_step_triton): the Triton
kernel (Triton's CPU interpreter without a GPU) and the PyTorch twin against short_conv_torch over the whole
sequence, on outputs, on the windows of the rows named and on every other slot."""

import os

import pytest
import torch

from k3.ops.conv_step_triton import (conv_step_inplace_torch, conv_step_inplace_triton, short_conv_step_inplace)
from k3.ops.short_conv import short_conv_torch

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")

SLOTS = 7


def case(batch: int, channels: int, taps: int, seed: int, dtype=torch.float32):
    """x as a column slice of a wider GEMM output (strided rows), a window pool, unsorted distinct rows."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, 1, channels + 5, generator=gen).to(dtype)
    x = wide[..., 2:2 + channels]
    weight = torch.randn(channels, taps, generator=gen).to(dtype)
    window = torch.randn(SLOTS, taps - 1, channels, generator=gen).to(dtype)
    rows = torch.randperm(SLOTS, generator=gen)[:batch]
    return x, weight, window, rows


def reference(x, weight, window, rows, parts):
    """short_conv_torch over [window, x] for each row: its last output, and its new tail."""
    y, new_tail = short_conv_torch(x, weight, window[rows.long()])
    batch, _, channels = x.shape
    return y.reshape(batch, parts, channels // parts).transpose(0, 1), new_tail


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("batch, channels, taps, parts, block_c, index_dtype", [
    (3, 48, 4, 3, 16, torch.int64),   # K3's 4 taps, q/k/v planar, three channel blocks
    (4, 40, 2, 1, 32, torch.int32),   # one tap of window, a ragged channel block, int32 rows
    (1, 24, 3, 2, 512, torch.int64),  # one row, one block wider than the channels
])
def test_conv_step_equals_the_convolution_and_slides_only_the_named_windows(impl, batch, channels, taps, parts,
                                                                            block_c, index_dtype):
    x, weight, window, rows = case(batch, channels, taps, seed=batch * 100 + channels)
    rows = rows.to(index_dtype)
    want_y, want_tail = reference(x, weight, window, rows, parts)
    before = window.clone()
    if impl == "torch":
        y = conv_step_inplace_torch(x, weight, window, rows, parts)
    else:
        y = conv_step_inplace_triton(x, weight, window, rows, parts, block_c=block_c)
    assert y.shape == (parts, batch, channels // parts) and y.is_contiguous()
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window[rows.long()], want_tail, rtol=0, atol=0)  # moved, not recomputed
    others = [s for s in range(SLOTS) if s not in rows.tolist()]
    assert torch.equal(window[others], before[others])


@interpreted
def test_dispatch_forced_kernel_equals_twin_in_bf16(monkeypatch):
    """Both through the public entry point ([P, B, 1, C / P] out), bf16 in and out, fp32 sums."""
    x, weight, window, rows = case(5, 96, 4, seed=3, dtype=torch.bfloat16)
    got = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("K3_CONV_STEP_BACKEND", backend)
        pool = window.clone()
        got[backend] = short_conv_step_inplace(x, weight, pool, rows, parts=3), pool
    (y_torch, pool_torch), (y_triton, pool_triton) = got["torch"], got["triton"]
    assert y_triton.shape == (3, 5, 1, 32) and y_triton.dtype == torch.bfloat16
    torch.testing.assert_close(y_triton.float(), y_torch.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(pool_triton, pool_torch)


@interpreted
def test_kernel_reads_strided_rows_and_a_window_in_another_dtype_like_the_twin():
    """Rows as every other entry of a longer tensor; an fp32 window under bf16 x: the taps go through x's dtype on
    the way in and on the shift, as in the twin (short_conv_step casts the tail to x's dtype)."""
    x, weight, _, _ = case(3, 48, 4, seed=9, dtype=torch.bfloat16)
    window = torch.randn(SLOTS, 3, 48, generator=torch.Generator().manual_seed(10))
    rows = torch.tensor([6, 0, 2, 5, 4, 1])[::2]
    assert not rows.is_contiguous()
    before, twin_window = window.clone(), window.clone()
    y = conv_step_inplace_triton(x, weight, window, rows, parts=3, block_c=32)
    want = conv_step_inplace_torch(x, weight, twin_window, rows, parts=3)
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)
    # To a unit of bf16's last place: the interpreter's fp32 -> bf16 cast need not round to nearest as torch does.
    torch.testing.assert_close(window, twin_window, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(window[rows], before[rows])  # the rows' windows did move


def test_the_op_declares_its_write_to_the_window_and_nothing_else():
    """Under torch.compile functionalisation orders the window's readers after the op only if it says so."""
    arguments = torch.ops.k3.conv_step_inplace.default._schema.arguments
    writes = [a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write]
    assert writes == ["window"]


def test_the_op_takes_its_inputs_in_any_strides():
    """The kernel reads x, the window and the rows through their strides (the case above slices x out of a wider
    output), so the op tells Inductor so: a padded GEMM output then needs no copy on its way in."""
    assert torch._C.Tag.flexible_layout in torch.ops.k3.conv_step_inplace.default.tags


def test_bad_inputs_say_what_fits(monkeypatch):
    x, weight, window, rows = case(3, 48, 4, seed=1)
    monkeypatch.setenv("K3_CONV_STEP_BACKEND", "torch")
    with pytest.raises(ValueError, match="one token"):
        short_conv_step_inplace(torch.cat([x, x], dim=1), weight, window, rows)
    with pytest.raises(ValueError, match=r"\[S, W-1, C\] = \[S, 3, 48\]"):
        short_conv_step_inplace(x, weight, window[:, :2], rows)
    with pytest.raises(ValueError, match="rows must be"):
        short_conv_step_inplace(x, weight, window, rows[:2])
    with pytest.raises(ValueError, match="parts must divide"):
        short_conv_step_inplace(x, weight, window, rows, parts=5)
    monkeypatch.setenv("K3_CONV_STEP_BACKEND", "fast")
    with pytest.raises(ValueError, match="K3_CONV_STEP_BACKEND"):
        short_conv_step_inplace(x, weight, window, rows)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 64])
def test_conv_step_cuda_bf16_equals_twin(batch):
    """`small`'s joined q/k/v conv (3 x 1024 channels, 4 taps) at decode batch sizes on the GPU."""
    x, weight, window, _ = case(batch, 3072, 4, seed=batch, dtype=torch.bfloat16)
    x, weight = x.cuda(), weight.cuda()
    window = torch.randn(batch + 3, 3, 3072, device="cuda").bfloat16()
    rows = torch.randperm(batch + 3, device="cuda")[:batch]
    twin_window = window.clone()
    y = conv_step_inplace_triton(x, weight, window, rows, parts=3)
    want = conv_step_inplace_torch(x, weight, twin_window, rows, parts=3)
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(window, twin_window)
