"""KDA's depthwise causal short convolution + SiLU for training and prefill from empty, as two Triton kernels
(k3.ops.short_conv_triton_kernels): forward, and a backward that recomputes the pre-activation from x.

    y_t = silu( sum_j w[:, W-1-j] * x_{t-j} ),   zeros before t = 0, taps never reach before a document's start

x [B, T, C] is read in place (a column slice of a wider GEMM output is fine: any batch and time strides, unit
channel stride); weight [C, W] with W <= MAX_WIDTH; packed documents come as B = 1 with cu_seqlens [N+1] (or
position_in_doc [T]). No cached tail: calls with one stay on k3.ops.short_conv's other paths.

Why: fla's causal_conv1d, the CUDA path before these kernels, took 136 us forward and 345 us backward, plus 136
for the forward it re-runs inside its backward, per call at `small`'s training shape on one H200 (x [4, 4096,
3072] bf16, W = 4): ~7.4 ms of a 150 ms step over 12 KDA layers, where the bytes allow ~50 us forward (x read, y
written) and ~75 backward (x and dy read, dx written). These kernels walk time in order inside a program, so x
and dy are each read once and the pre-activation and its sigmoid are computed once per element, forward and
backward (an earlier tile-based version recomputed dpre at the W shifts a tile needs, W sigmoids and W^2 loads
an element, and was 3.7 ms a call backward). dweight is summed per program into a [tiles, W, C] fp32 buffer
that torch sums: deterministic, no atomics.

The PyTorch twin is k3.ops.short_conv.short_conv_torch, held equal (with an fp64 oracle) by
tests/ops/test_short_conv_triton.py, through Triton's CPU interpreter (TRITON_INTERPRET=1) without a GPU;
k3.ops.short_conv picks the path (K3_CONV_BACKEND). Eager only: under torch.compile short_conv keeps fla's op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.ops.triton_support import interpreting, kernel_module

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# W is unrolled into the kernels (and the rows kept in registers grow with it); KDA's convs have W = 4.
MAX_WIDTH = 8
# Output parts the kernels take (a pointer argument each; q, k, v are three).
MAX_PARTS = 4


@dataclass(frozen=True)
class ConvBlocks:
    """Launch shape: a program takes block_t consecutive times of block_c channels of one batch row, walking
    them rows at a time (rows divides block_t; that many rows of x, and of dy, are loaded at once)."""
    block_t: int
    block_c: int
    rows: int = 8
    num_warps: int = 2


# 256 channels over 2 warps is 4 channels a thread (8-byte bf16 loads) with the rows it keeps in registers (W-1
# inputs, W-1 pending dx rows, W dweight sums, W taps); 8 rows a step keep 8 (forward) or 16 (backward) loads in
# flight per thread. 64 times a program forward gives 3,072 programs at `small`'s shape; backward, 128 times halves
# the dweight buffer (128 tiles x 4 x 3072 fp32, 6 MB at that shape) for 1,536 programs. bench/conv.py on one H100
# at `small`'s shape: forward 85 us (1.24x the bytes' floor), backward 199 us joined and 255 planar (1.9-2.5x),
# where fla's causal_conv1d took 234 and 799. Its --sweep found no launch shape clearly better: the best forward
# (32 x 256) was 84 us, and its backward times scattered (0.24-0.48 ms) without a pattern the main rows bore out.
FORWARD_BLOCKS = ConvBlocks(block_t=64, block_c=256, rows=8, num_warps=2)
BACKWARD_BLOCKS = ConvBlocks(block_t=128, block_c=256, rows=8, num_warps=2)


def kernels():
    return kernel_module("k3.ops.short_conv_triton_kernels", interpreting())


def check_short_conv_inputs(x: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor | None,
                            position_in_doc: torch.Tensor | None) -> None:
    """Raise a ValueError naming what does not fit; metadata only (no device sync: cu_seqlens[-1] == T is the
    caller's to keep)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    batch, length, channels = x.shape
    if x.dtype not in DTYPES or weight_CW.dtype not in DTYPES:
        raise ValueError(f"x and weight_CW must be one of {DTYPES}, got {x.dtype} and {weight_CW.dtype}")
    if weight_CW.dim() != 2 or weight_CW.shape[0] != channels or not 1 <= weight_CW.shape[1] <= MAX_WIDTH:
        raise ValueError(f"weight_CW must be [C, W] = [{channels}, 1..{MAX_WIDTH}], got {tuple(weight_CW.shape)}")
    if x.stride(2) != 1 and channels > 1:
        raise ValueError(f"x must have contiguous channels (stride 1 on its last dim), got strides {x.stride()}; "
                         "a column slice of a wider [B, T, N] tensor is fine, a transposed view is not")
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"packed documents (cu_seqlens) need B = 1, got x {tuple(x.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be [N+1] int32 or int64 with N >= 1, got "
                             f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if position_in_doc is not None:
        if batch != 1:
            raise ValueError(f"packed documents (position_in_doc) need B = 1, got x {tuple(x.shape)}")
        if tuple(position_in_doc.shape) != (length,) or position_in_doc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"position_in_doc must be [T] = [{length}] int32 or int64, got "
                             f"{tuple(position_in_doc.shape)} {position_in_doc.dtype}")
    tensors = (x, weight_CW, cu_seqlens, position_in_doc)
    if len({t.device for t in tensors if t is not None}) != 1:
        raise ValueError("x, weight_CW, cu_seqlens and position_in_doc must share a device, got "
                         + ", ".join(str(t.device) for t in tensors if t is not None))


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[N+1] document boundaries -> position_in_doc [T] int32 (0 at each document start), on the device and
    without a host sync (searchsorted where repeat_interleave would read the lengths back)."""
    times = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    document = torch.searchsorted(cu_seqlens[1:], times, right=True)
    return (times - cu_seqlens.gather(0, document.clamp_max(cu_seqlens.numel() - 1))).to(torch.int32)


def _grid(batch: int, length: int, channels: int, parts: int, blocks: ConvBlocks) -> tuple[int, int, int]:
    import triton

    return (triton.cdiv(length, blocks.block_t), parts * triton.cdiv(channels // parts, blocks.block_c), batch)


def _check_blocks(blocks: ConvBlocks) -> None:
    if (blocks.block_t < 1 or blocks.rows < 1 or blocks.block_t % blocks.rows or blocks.block_c < 1
            or blocks.block_c & (blocks.block_c - 1)):
        raise ValueError(f"{blocks}: rows must divide block_t and block_c must be a power of two")


def _slots(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kernels' MAX_PARTS pointer slots: the parts' tensors, the first repeated in the unused ones."""
    return tensors + [tensors[0]] * (MAX_PARTS - len(tensors))


def conv_forward(x: torch.Tensor, weight_CW: torch.Tensor, position_in_doc: torch.Tensor | None,
                 blocks: ConvBlocks | None = None, parts: int = 1) -> tuple[torch.Tensor, ...]:
    """x [B, T, C] (unit channel stride), weight [C, W], position_in_doc [T] int32 or None -> `parts` tensors
    y_p [B, T, C / parts], each contiguous in x's dtype (column block p of the joined output)."""
    blocks = blocks or FORWARD_BLOCKS
    _check_blocks(blocks)
    batch, length, channels = x.shape
    ys = [torch.empty(batch, length, channels // parts, dtype=x.dtype, device=x.device) for _ in range(parts)]
    if x.numel():
        kernels().short_conv_forward[_grid(batch, length, channels, parts, blocks)](
            x, weight_CW, x if position_in_doc is None else position_in_doc, *_slots(ys), length,
            channels // parts, x.stride(0), x.stride(1), weight_CW.stride(0), weight_CW.stride(1),
            ys[0].stride(0), ys[0].stride(1), W=weight_CW.shape[1], PACKED=position_in_doc is not None,
            PARTS=parts, BLOCK_T=blocks.block_t, BLOCK_C=blocks.block_c, ROWS=blocks.rows,
            num_warps=blocks.num_warps)
    return tuple(ys)


def _readable(dy: torch.Tensor | None, x: torch.Tensor, parts: int) -> torch.Tensor:
    """A part's output gradient as the kernel reads it: in place when its channels are contiguous; autograd's
    None for an unused output as one row of zeros broadcast over batch and time (strides 0, 0, 1: the kernel
    reads the same [C / parts] zeros everywhere, no [B, T, C / parts] buffer)."""
    batch, length, channels = x.shape
    if dy is None:
        return x.new_zeros(channels // parts).expand(batch, length, channels // parts)
    dy = dy.to(x.dtype)  # the parts share one pointer type in the kernel
    return dy if dy.stride(2) == 1 or dy.shape[2] == 1 else dy.contiguous()


def conv_backward(dys: list[torch.Tensor | None], x: torch.Tensor, weight_CW: torch.Tensor,
                  position_in_doc: torch.Tensor | None,
                  blocks: ConvBlocks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dys: each part's output gradient [B, T, C / parts] (unit channel stride, else copied; None: zeros), x
    and weight as forward -> (dx [B, T, C] contiguous in x's dtype, dweight [C, W] fp32)."""
    blocks = blocks or BACKWARD_BLOCKS
    _check_blocks(blocks)
    batch, length, channels = x.shape
    parts, width = len(dys), weight_CW.shape[1]
    dys = [_readable(dy, x, parts) for dy in dys]
    grid = _grid(batch, length, channels, parts, blocks)
    dx = torch.empty(batch, length, channels, dtype=x.dtype, device=x.device)
    # [tiles, W, C] rather than [tiles, C, W]: a program's stores of one tap's sums are contiguous channels.
    dw_partial = torch.empty(batch * grid[0], width, channels, dtype=torch.float32, device=x.device)
    if dx.numel():
        slots = _slots(dys)
        kernels().short_conv_backward[grid](
            x, weight_CW, x if position_in_doc is None else position_in_doc, *slots, dx, dw_partial, length,
            channels // parts, x.stride(0), x.stride(1), *(dy.stride(0) for dy in slots),
            *(dy.stride(1) for dy in slots), dx.stride(0), dx.stride(1), weight_CW.stride(0), weight_CW.stride(1),
            W=width, PACKED=position_in_doc is not None, PARTS=parts, BLOCK_T=blocks.block_t,
            BLOCK_C=blocks.block_c, ROWS=blocks.rows, num_warps=blocks.num_warps)
    return dx, dw_partial.sum(0).t()


class _ShortConv(torch.autograd.Function):
    """The joined conv or its planar parts: forward returns `parts` tensors, backward takes each one's
    gradient where it lies (None for an output that was not used) and writes one joined dx."""

    @staticmethod
    def forward(ctx, x, weight_CW, position_in_doc, parts, blocks, backward_blocks):
        ctx.save_for_backward(x, weight_CW, position_in_doc)
        ctx.backward_blocks = backward_blocks
        ctx.set_materialize_grads(False)  # an unused part's gradient stays None, not a [B, T, C / parts] of zeros
        ys = conv_forward(x, weight_CW, position_in_doc, blocks, parts)
        return ys[0] if parts == 1 else ys

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *dys):
        x, weight_CW, position_in_doc = ctx.saved_tensors
        dx, dw = conv_backward(list(dys), x, weight_CW, position_in_doc, ctx.backward_blocks)
        return (dx if ctx.needs_input_grad[0] else None,
                dw.to(weight_CW.dtype).contiguous() if ctx.needs_input_grad[1] else None, None, None, None, None)


def _positions(x: torch.Tensor, cu_seqlens: torch.Tensor | None,
               position_in_doc: torch.Tensor | None) -> torch.Tensor | None:
    if position_in_doc is not None:
        return position_in_doc.to(torch.int32).contiguous()
    if cu_seqlens is not None:
        return positions_from_cu_seqlens(cu_seqlens, x.shape[1])
    return None


def _run(x, weight_CW, cu_seqlens, position_in_doc, parts, blocks, backward_blocks):
    check_short_conv_inputs(x, weight_CW, cu_seqlens, position_in_doc)
    if blocks is not None:
        _check_blocks(blocks)
    if backward_blocks is not None:
        _check_blocks(backward_blocks)
    position_in_doc = _positions(x, cu_seqlens, position_in_doc)
    if torch.is_grad_enabled() and (x.requires_grad or weight_CW.requires_grad):
        ys = _ShortConv.apply(x, weight_CW, position_in_doc, parts, blocks, backward_blocks)
        return (ys,) if parts == 1 else tuple(ys)
    return conv_forward(x, weight_CW, position_in_doc, blocks, parts)


def short_conv_triton(x: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                      position_in_doc: torch.Tensor | None = None, blocks: ConvBlocks | None = None,
                      backward_blocks: ConvBlocks | None = None) -> torch.Tensor:
    """silu(causal depthwise conv(x)) without a cached tail: x [B, T, C] (fp32, bf16 or fp16; unit channel
    stride, any other strides), weight [C, W] (W <= MAX_WIDTH; x's dtype or another of DTYPES: the kernels read
    it as it is, in fp32), packed documents (B = 1) by cu_seqlens [N+1] or position_in_doc [T] (0 at each
    document start; taken as given when both come) -> y [B, T, C] contiguous in x's dtype, with gradients for x
    (x's dtype) and weight (weight's dtype). `blocks` (forward) and `backward_blocks` are for tests and sweeps
    (FORWARD_BLOCKS / BACKWARD_BLOCKS when None)."""
    return _run(x, weight_CW, cu_seqlens, position_in_doc, 1, blocks, backward_blocks)[0]


def short_conv_triton_parts(x: torch.Tensor, weight_CW: torch.Tensor, parts: int,
                            cu_seqlens: torch.Tensor | None = None, position_in_doc: torch.Tensor | None = None,
                            blocks: ConvBlocks | None = None,
                            backward_blocks: ConvBlocks | None = None) -> tuple[torch.Tensor, ...]:
    """short_conv_triton's output as `parts` contiguous column blocks [B, T, C / parts] (planar q, k, v for the
    joined conv) from one launch, with no split and no copy: fla's chunk_kda takes them as they are, where
    column slices of the joined output cost it a contiguous copy each (~2 ms a `small` step), and their
    gradients come back separately, read in place, into one joined dx (no cat of dq, dk, dv: ~1.5 ms more).
    parts in 1..MAX_PARTS must divide C; the rest as short_conv_triton."""
    if not isinstance(parts, int) or not 1 <= parts <= MAX_PARTS or x.dim() != 3 or x.shape[-1] % parts:
        raise ValueError(f"parts must be an int in 1..{MAX_PARTS} dividing x's channels (x {tuple(x.shape)}), "
                         f"got {parts!r}")
    return _run(x, weight_CW, cu_seqlens, position_in_doc, parts, blocks, backward_blocks)
