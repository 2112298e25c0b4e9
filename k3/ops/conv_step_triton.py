"""One decode token of the KDA short convs, with the conv window advanced where it lives, as one Triton kernel.

    y [P, B, C / P] = silu(conv(window[rows], x))   then   window[rows] <- [window[rows][:, 1:], x]

x [B, 1, C] is the token's conv input (a column slice of the fused input GEMM is fine: any strides); weight_CW
[C, W]; window [S, W-1, C] holds each row's last W-1 inputs at slot rows[b] (a static cache's window with rows
0..B-1, or the engine pool's layer buffer with the rows' slots). The output comes planar, P parts side by side
([3, B, C / 3] for the joined q/k/v conv), so that each part is contiguous, as fla's recurrent KDA kernel takes it.

Why: compiled, the PyTorch form of this step was seven kernels per KDA layer on one H200 at batch 64 (`small`):
the window concatenated with x and the tap sum (3.9 us), q, k and v each written contiguous (three of 1.2 us),
and the window's shift back into the cache (two of 1.4 us). Here it is one kernel; beta's contiguous copy stays.

`short_conv_step_inplace` dispatches: K3_CONV_STEP_BACKEND = auto (the kernel for CUDA inputs outside autograd
when Triton imports), torch, or triton (forced; the CPU interpreter runs it in the tests). Under torch.compile the
kernel is the custom op `k3::conv_step_inplace`, declared to write the window. The PyTorch twin gathers the rows'
windows, runs k3.ops.short_conv.short_conv_step and scatters them back; tests/ops/test_conv_step_triton.py holds
the two equal.
"""

from __future__ import annotations

import torch

from k3 import kernels
from k3.ops.fused_backend import with_torch_fallback
from k3.ops.short_conv import short_conv_step
from k3.ops.triton_support import ANY_STRIDES, interpreting, kernel_module, triton_importable

BLOCK_C = 512


def conv_step_backend() -> str:
    return kernels.choice("conv_step")


def check_conv_step(x: torch.Tensor, weight_CW: torch.Tensor, window: torch.Tensor, rows: torch.Tensor,
                    parts: int) -> None:
    """Raise a ValueError naming what does not fit; metadata only (no device sync)."""
    if x.dim() != 3 or x.shape[1] != 1:
        raise ValueError(f"x must be one token [B, 1, C], got {tuple(x.shape)}")
    batch, _, channels = x.shape
    if weight_CW.dim() != 2 or weight_CW.shape[0] != channels or weight_CW.shape[1] < 2:
        raise ValueError(f"weight_CW must be [C, W] = [{channels}, W >= 2], got {tuple(weight_CW.shape)}")
    taps = weight_CW.shape[1]
    if window.dim() != 3 or tuple(window.shape[1:]) != (taps - 1, channels):
        raise ValueError(f"window must be [S, W-1, C] = [S, {taps - 1}, {channels}], got {tuple(window.shape)}")
    if rows.dim() != 1 or rows.shape[0] != batch or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be [B] = [{batch}] int32 or int64, got {tuple(rows.shape)} {rows.dtype}")
    if parts < 1 or channels % parts:
        raise ValueError(f"parts must divide the {channels} channels, got {parts}")
    if len({t.device for t in (x, weight_CW, window, rows)}) != 1:
        raise ValueError("x, weight_CW, window and rows must share a device")


def conv_step_inplace_torch(x: torch.Tensor, weight_CW: torch.Tensor, window: torch.Tensor, rows: torch.Tensor,
                            parts: int = 1) -> torch.Tensor:
    """The PyTorch twin: gather the rows' windows, one conv step, scatter the slid windows back."""
    rows = rows.long()  # index_copy_ takes int64 only
    y, new_window = short_conv_step(x, weight_CW, window.index_select(0, rows))
    window.index_copy_(0, rows, new_window.to(window.dtype))
    batch, _, channels = x.shape
    return y.reshape(batch, parts, channels // parts).transpose(0, 1).contiguous()


def conv_step_inplace_triton(x: torch.Tensor, weight_CW: torch.Tensor, window: torch.Tensor, rows: torch.Tensor,
                             parts: int = 1, block_c: int = BLOCK_C, num_warps: int = 4) -> torch.Tensor:
    """The kernel (k3.ops.conv_step_triton_kernels.conv_step): one program per row and block_c channels."""
    import triton

    batch, _, channels = x.shape
    out = x.new_empty(parts, batch, channels // parts)
    if batch:
        kernel_module("k3.ops.conv_step_triton_kernels", interpreting()).conv_step[
            (batch, triton.cdiv(channels, block_c))](
            x, weight_CW, window, rows, out, batch, channels, channels // parts, x.stride(0), x.stride(2),
            weight_CW.stride(0), weight_CW.stride(1), window.stride(0), window.stride(1), window.stride(2),
            rows.stride(0), TAPS=weight_CW.shape[1], BLOCK_C=block_c, num_warps=num_warps)
    return out


@torch.library.custom_op("k3::conv_step_inplace", mutates_args=("window",), tags=ANY_STRIDES)
def conv_step_inplace_op(x: torch.Tensor, weight_CW: torch.Tensor, window: torch.Tensor, rows: torch.Tensor,
                         parts: int) -> torch.Tensor:
    return conv_step_inplace_triton(x, weight_CW, window, rows, parts)


@conv_step_inplace_op.register_fake
def _(x, weight_CW, window, rows, parts):
    return x.new_empty(parts, x.shape[0], x.shape[2] // parts)


def _triton_call(x, weight_CW, window, rows, parts) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return conv_step_inplace_op(x, weight_CW, window, rows, parts)
    return conv_step_inplace_triton(x, weight_CW, window, rows, parts)


def short_conv_step_inplace(x: torch.Tensor, weight_CW: torch.Tensor, window: torch.Tensor, rows: torch.Tensor,
                            parts: int = 1) -> torch.Tensor:
    """One decode token through the short conv (silu), its window advanced in place: returns y [P, B, 1, C / P]
    in x's dtype (see the module doc). Inference only: no backward through the kernel."""
    check_conv_step(x, weight_CW, window, rows, parts)
    weight_CW = weight_CW.to(x.dtype)  # as the fla and PyTorch convs take it
    backend = conv_step_backend()
    grad = torch.is_grad_enabled() and (x.requires_grad or weight_CW.requires_grad)
    if backend == "torch" or grad or (backend == "auto" and not (x.is_cuda and triton_importable())):
        y = conv_step_inplace_torch(x, weight_CW, window, rows, parts)
    elif backend == "triton":
        y = _triton_call(x, weight_CW, window, rows, parts)
    else:
        # A failed compile falls back to the twin, once for the process. The window must not have moved then:
        # Triton compiles before it launches, so a failure leaves it as it was.
        y = with_torch_fallback(("conv_step", x.dtype, window.dtype, weight_CW.shape[1]),
                                lambda: _triton_call(x, weight_CW, window, rows, parts),
                                lambda: conv_step_inplace_torch(x, weight_CW, window, rows, parts))
    return y.unsqueeze(2)
