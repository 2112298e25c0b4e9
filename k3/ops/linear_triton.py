"""A few rows times a large weight (a decode step's projections at small batch) as one Triton kernel.

    out [M, N] = x [M, K] W[N, K]^T        M <= SKINNY_MAX_ROWS (64)

Why: at batch 1 cuBLAS ran `small`'s decode projections (0.25-9 MB of weights) at 3-7.5 us each on one H200,
where the bytes take 0.1-2 us: 120 such GEMMs were a third of the step's kernel time. This kernel gives each
program BLOCK_N output columns and streams their slice of W once. Measured at one token, 15 layers of distinct
weights in one CUDA graph (bench/moe_decode.py --dense; an empty Triton launch costs 1.3 us there): o_proj
[1024, 1024] 7.5 -> 3.2 us, the latent up [1024, 512] 5.1 -> 2.4, KDA's f_b [1024, 128] 3.1 -> 1.7, the latent
down [512, 1024] 4.0 -> 3.2, the shared gate+up [2048, 1024] 5.0 -> 4.5; KDA's fused input [4232, 1024] and the
LM head [32768, 1024] were even (1.04x, 1.02x), so auto keeps cuBLAS from SKINNY_MAX_WEIGHT elements up.

`project(linear, x)` is what the layers call for their projections: the kernel where it pays (K3_LINEAR_BACKEND=
auto|torch|triton; auto: CUDA, half precision, inference, one row and a weight below SKINNY_MAX_WEIGHT elements, or
up to SKINNY_AUTO_MAX_ROWS rows and a weight of at most SKINNY_ROWS_MAX_WEIGHT), else the module itself. Under
torch.compile the kernel is the custom op `k3::skinny_linear`. The PyTorch twin is torch.nn.functional.linear,
held equal by tests/ops/test_linear_triton.py (through Triton's CPU interpreter without a GPU).
"""

from __future__ import annotations

import torch
from torch import nn

from k3 import kernels
from k3.ops.fused_backend import with_torch_fallback
from k3.ops.triton_support import ANY_STRIDES, interpreting, kernel_module, triton_importable

SKINNY_MAX_ROWS = 64
# Auto-selection bounds (bench/moe_decode.py --dense, one H200). At one row the kernel won up to the 2M-element
# shared gate+up and was even from 4.3M elements. At 64 rows it won on weights of up to 1M elements (o_proj
# [1024, 1024] 4.6 -> 3.7 us, the latent up 3.3 -> 2.6, KDA's f_b 2.7 -> 2.2) and lost on the 2M-5M-element fused
# groups (KDA's input 5.8 -> 6.8 us, the MoE output group 5.5 -> 6.6), so past one row it takes the smaller ones.
SKINNY_AUTO_MAX_ROWS = 64
SKINNY_MAX_WEIGHT = 1 << 21
SKINNY_ROWS_MAX_WEIGHT = 1 << 20  # inclusive, for more than one row


def default_blocks(in_width: int, rows: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), the sweep's best at one token on one H200: a row of up to 512
    inputs in one load, longer rows in 256-wide steps three deep. Past 16 rows the x tile grows with the rows
    (BLOCK_M = rows rounded up to a power of two), so the steps are 128 wide."""
    if rows > 16:
        return (16, 128, 4, 3)
    return (16, 512, 4, 2) if in_width <= 512 else (16, 256, 4, 3)


def block_rows(rows: int) -> int:
    """BLOCK_M: the rows rounded up to a power of two, at least tl.dot's minimum of 16."""
    return max(16, 1 << (max(rows, 1) - 1).bit_length())


def skinny_linear_eager(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                        block_k: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None) -> torch.Tensor:
    """x [..., K] (at most SKINNY_MAX_ROWS rows in all), weight [N, K] -> [..., N] in x's dtype. Blocks, warps
    and stages left None come from default_blocks."""
    import triton

    rows = x.reshape(-1, x.shape[-1])
    num_rows, in_width = rows.shape
    defaults = default_blocks(in_width, num_rows)
    block_n, block_k, num_warps, num_stages = (d if v is None else v for v, d in
                                               zip((block_n, block_k, num_warps, num_stages), defaults))
    out_width = weight.shape[0]
    if weight.shape[1] != in_width:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of width {in_width}")
    if num_rows > SKINNY_MAX_ROWS:
        raise ValueError(f"{num_rows} rows; the skinny kernel takes at most {SKINNY_MAX_ROWS}")
    out = rows.new_empty(num_rows, out_width)
    if num_rows:
        weight = weight.to(rows.dtype)
        block_k = min(block_k, max(16, triton.next_power_of_2(in_width)))
        kernel_module("k3.ops.linear_triton_kernels", interpreting()).skinny_matmul[(triton.cdiv(out_width, block_n),)](
            rows, weight, out, num_rows, rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1),
            out.stride(0), out.stride(1), out_width, in_width, UPCAST=interpreting(), BLOCK_M=block_rows(num_rows),
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out.view(*x.shape[:-1], out_width)


@torch.library.custom_op("k3::skinny_linear", mutates_args=(), tags=ANY_STRIDES)
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return skinny_linear_eager(x, weight)


@skinny_linear_op.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """skinny_linear_eager with its default blocks, as one opaque op under torch.compile. No backward."""
    if torch.compiler.is_compiling():
        return skinny_linear_op(x, weight)
    return skinny_linear_eager(x, weight)


def linear_backend() -> str:
    return kernels.choice("linear")


def skinny_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Never under autograd (no backward) nor past SKINNY_MAX_ROWS rows; else when forced by
    K3_LINEAR_BACKEND=triton, or with auto on CUDA in half precision within the auto bounds."""
    # The cheap shape test first: prefill and training call this for every projection, host-bound.
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > SKINNY_MAX_ROWS:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    backend = linear_backend()
    if backend != "auto":
        return backend == "triton"
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and within_auto_bounds(rows, weight.numel()) and triton_importable())


def within_auto_bounds(rows: int, weight_elements: int) -> bool:
    """Where auto takes the kernel (the measured wins): one row and a weight below SKINNY_MAX_WEIGHT elements, or
    up to SKINNY_AUTO_MAX_ROWS rows and at most SKINNY_ROWS_MAX_WEIGHT."""
    if rows == 1:
        return weight_elements < SKINNY_MAX_WEIGHT
    return rows <= SKINNY_AUTO_MAX_ROWS and weight_elements <= SKINNY_ROWS_MAX_WEIGHT


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T without bias: the skinny kernel where skinny_pays, else torch's linear."""
    if not skinny_pays(x, weight):
        return torch.nn.functional.linear(x, weight)
    return _skinny_or_torch(x, weight)


def project(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) for a layer's projection: the skinny kernel where skinny_pays (a module with a bias or forward
    hooks is always called as itself)."""
    if module.bias is not None or module._forward_hooks or module._forward_pre_hooks:
        return module(x)
    if not skinny_pays(x, module.weight):
        return module(x)
    return _skinny_or_torch(x, module.weight)


def _skinny_or_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if linear_backend() == "triton":
        return skinny_linear(x, weight)
    return with_torch_fallback(("skinny_linear", tuple(weight.shape), x.dtype), lambda: skinny_linear(x, weight),
                               lambda: torch.nn.functional.linear(x, weight))
