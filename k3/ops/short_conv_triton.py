"""KDA's short convolution + SiLU for training and cache-less prefill, as two Triton kernels (forward, backward).

    y_t = silu( sum_j w[:, W-1-j] * x_{t-j} ),   tap j counts only when t - j >= 0 and position_in_doc[t] >= j

x [B, T, C] is read in place (a column slice of a wider GEMM output is fine: any row stride, unit channel
stride); weight [C, W]; position_in_doc [T] (0 at each document start) for packed documents, or None. Sums are
fp32, y comes in x's dtype. With planes = P > 1 the output is one contiguous [P, B, T, C / P] tensor whose plane
p holds channels p*C/P .. (p+1)*C/P: KDA's joined q|k|v conv then hands q, k and v to the recurrence contiguous
as they are, where column slices of a [B, T, C] output would each be copied.

Why: fla's causal_conv1d, which k3.ops.short_conv calls otherwise, ran at 137 us forward and 344 + 134 us
(backward + its recomputed forward) per `small` KDA layer on one H200 (B 4, T 4096, C 3 x 1024, bf16), where the
bytes allow about 50 and 75 us, and its [B, T, C] output cost three 41 us copies into the recurrence.
The backward recomputes the pre-activation from x (only x and weight are kept) and sums dweight per program into
a [programs, C, W] fp32 buffer that torch sums: deterministic, no atomics.

The PyTorch twin is k3.ops.short_conv.short_conv_torch, held equal by tests/ops/test_short_conv_triton.py
(Triton's CPU interpreter, TRITON_INTERPRET=1, without a GPU). k3.ops.short_conv dispatches here under
K3_SHORT_CONV=triton. Eager only: torch.compile keeps fla's op (k3.ops.short_conv).
"""

from __future__ import annotations

import torch

from k3.ops.triton_support import Blocks, interpreting, kernel_module

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Launch shapes: block_n times by block_d channels per tile; a backward Blocks' `programs` is how many programs
# share the time axis (None: BACKWARD_TILES_PER_PROGRAM tiles each). Untuned until measured on a GPU: tiles of
# 4K-8K elements (16-byte bf16 loads along channels, 16-64 values a thread), and backward programs that loop
# over a few time tiles so that the dweight buffer stays at a few MB (6 MB at `small`'s training shape).
FORWARD_BLOCKS = Blocks(block_n=64, block_d=128, num_warps=4)
BACKWARD_BLOCKS = Blocks(block_n=32, block_d=128, num_warps=4)
BACKWARD_TILES_PER_PROGRAM = 4


def kernels():
    return kernel_module("k3.ops.short_conv_triton_kernels", interpreting())


def _check(x: torch.Tensor, weight_CW: torch.Tensor, position_in_doc: torch.Tensor | None, planes: int) -> None:
    if x.dim() != 3 or x.dtype not in DTYPES or weight_CW.dtype not in DTYPES:
        raise ValueError(f"x must be [B, T, C] and x, weight_CW in {DTYPES}, got x {tuple(x.shape)} {x.dtype} and "
                         f"weight_CW {weight_CW.dtype}")
    batch, length, channels = x.shape
    if weight_CW.dim() != 2 or weight_CW.shape[0] != channels:
        raise ValueError(f"weight_CW must be [C, W] = [{channels}, W], got {tuple(weight_CW.shape)}")
    if planes < 1 or channels % planes:
        raise ValueError(f"planes must divide the {channels} channels, got {planes}")
    if position_in_doc is not None and (tuple(position_in_doc.shape) != (length,)
                                        or position_in_doc.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"position_in_doc must be [T] = [{length}] int32 or int64, got "
                         f"{tuple(position_in_doc.shape)} {position_in_doc.dtype}")
    if len({t.device for t in (x, weight_CW, position_in_doc) if t is not None}) != 1:
        raise ValueError("x, weight_CW and position_in_doc must share a device")


def conv_forward(x: torch.Tensor, weight_CW: torch.Tensor, position_in_doc: torch.Tensor | None, planes: int,
                 blocks: Blocks | None = None) -> torch.Tensor:
    """x [B, T, C] (unit channel stride) -> y contiguous in x's dtype: [B, T, C] for planes = 1, else
    [P, B, T, C / P] (see the module doc)."""
    import triton

    blocks = blocks or FORWARD_BLOCKS
    batch, length, channels = x.shape
    part_width = channels // planes
    y = x.new_empty(planes, batch, length, part_width)
    if y.numel():
        grid = (triton.cdiv(length, blocks.block_n), planes * triton.cdiv(part_width, blocks.block_d), batch)
        kernels().short_conv_forward[grid](
            x, weight_CW, x if position_in_doc is None else position_in_doc, y, batch, length, part_width,
            x.stride(0), x.stride(1), weight_CW.stride(0), weight_CW.stride(1), W=weight_CW.shape[1],
            HAS_POS=position_in_doc is not None, BLOCK_T=blocks.block_n, BLOCK_C=blocks.block_d,
            num_warps=blocks.num_warps)
    return y[0] if planes == 1 else y


def conv_backward(dy: torch.Tensor, x: torch.Tensor, weight_CW: torch.Tensor, position_in_doc: torch.Tensor | None,
                  planes: int, blocks: Blocks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dy in y's layout (made contiguous here), x [B, T, C] (unit channel stride) -> (dx [B, T, C] contiguous in
    x's dtype, dweight [C, W] fp32)."""
    import triton

    blocks = blocks or BACKWARD_BLOCKS
    batch, length, channels = x.shape
    part_width, width = channels // planes, weight_CW.shape[1]
    dy = dy.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(length, blocks.block_n)
    programs_t = blocks.programs or triton.cdiv(tiles, BACKWARD_TILES_PER_PROGRAM)
    tiles_per_program = max(1, triton.cdiv(tiles, max(1, programs_t)))
    programs_t = triton.cdiv(tiles, tiles_per_program)
    dw_partial = torch.empty(batch * programs_t, channels, width, dtype=torch.float32, device=x.device)
    if dx.numel():
        grid = (programs_t, planes * triton.cdiv(part_width, blocks.block_d), batch)
        kernels().short_conv_backward[grid](
            x, weight_CW, x if position_in_doc is None else position_in_doc, dy, dx, dw_partial, batch, length,
            channels, part_width, tiles_per_program, x.stride(0), x.stride(1), weight_CW.stride(0),
            weight_CW.stride(1), W=width, HAS_POS=position_in_doc is not None, BLOCK_T=blocks.block_n,
            BLOCK_C=blocks.block_d, BLOCK_W=triton.next_power_of_2(width), num_warps=blocks.num_warps)
    else:
        dw_partial.zero_()
    return dx, dw_partial.sum(0)


class _ShortConvTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_CW, position_in_doc, planes, blocks, backward_blocks):
        ctx.save_for_backward(x, weight_CW, position_in_doc)
        ctx.planes, ctx.backward_blocks = planes, backward_blocks
        return conv_forward(x, weight_CW, position_in_doc, planes, blocks)

    @staticmethod
    def backward(ctx, dy):
        x, weight_CW, position_in_doc = ctx.saved_tensors
        dx, dw = conv_backward(dy, x, weight_CW, position_in_doc, ctx.planes, ctx.backward_blocks)
        return (dx if ctx.needs_input_grad[0] else None,
                dw.to(weight_CW.dtype) if ctx.needs_input_grad[1] else None, None, None, None, None)


def short_conv_train(x: torch.Tensor, weight_CW: torch.Tensor, position_in_doc: torch.Tensor | None = None,
                     planes: int = 1, blocks: Blocks | None = None,
                     backward_blocks: Blocks | None = None) -> torch.Tensor:
    """silu(causal depthwise conv(x)) with no cache: x [B, T, C] (fp32, bf16 or fp16; any row stride), weight
    [C, W], position_in_doc [T] int or None -> y [B, T, C] contiguous (planes = 1) or [P, B, T, C / P] (planes =
    P), in x's dtype, with gradients for x (x's dtype, contiguous) and weight (weight's dtype). `blocks` and
    `backward_blocks` (block_n times by block_d channels) are for tests and sweeps (defaults above when None)."""
    _check(x, weight_CW, position_in_doc, planes)
    if x.stride(2) != 1:  # the kernels read channels (and positions) with unit stride
        x = x.contiguous()
    if position_in_doc is not None:
        position_in_doc = position_in_doc.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight_CW.requires_grad):
        return _ShortConvTrain.apply(x, weight_CW, position_in_doc, planes, blocks, backward_blocks)
    return conv_forward(x, weight_CW, position_in_doc, planes, blocks)
