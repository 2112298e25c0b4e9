"""A few rows times a large weight (a decode step's projections at small batch) as one Triton kernel.

    out [M, N] = x [M, K] W[N, K]^T        M <= SKINNY_MAX_ROWS

Why: at batch 1 cuBLAS ran `small`'s decode projections (1-16 MB of weights) at about 5 us each on one H200,
where the bytes take 0.3-3 us: 120 such GEMMs were a third of the step's kernel time. This kernel gives each
program BLOCK_N output columns and streams their slice of W once. Not yet used by the layers: bench/skinny_gemm.py
measures it against cuBLAS first.

The PyTorch twin is torch.nn.functional.linear, held equal by tests/ops/test_linear_triton.py (through Triton's CPU
interpreter without a GPU).
"""

from __future__ import annotations

import functools

import torch

from k3.ops.moe_triton import _interpreting

SKINNY_MAX_ROWS = 16


@functools.lru_cache(maxsize=2)
def kernels(interpret: bool):
    import importlib

    from k3.ops import linear_triton_kernels as module

    if module.INTERPRETED != interpret:
        module = importlib.reload(module)
    return module


def skinny_linear_eager(x: torch.Tensor, weight: torch.Tensor, block_n: int = 32, block_k: int = 256,
                        num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [..., K] (at most SKINNY_MAX_ROWS rows in all), weight [N, K] -> [..., N] in x's dtype."""
    import triton

    rows = x.reshape(-1, x.shape[-1])
    num_rows, in_width = rows.shape
    out_width = weight.shape[0]
    if weight.shape[1] != in_width:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of width {in_width}")
    if num_rows > SKINNY_MAX_ROWS:
        raise ValueError(f"{num_rows} rows; the skinny kernel takes at most {SKINNY_MAX_ROWS}")
    out = rows.new_empty(num_rows, out_width)
    if num_rows:
        weight = weight.to(rows.dtype)
        block_k = min(block_k, max(16, triton.next_power_of_2(in_width)))
        kernels(_interpreting()).skinny_matmul[(triton.cdiv(out_width, block_n),)](
            rows, weight, out, num_rows, rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1),
            out.stride(0), out.stride(1), out_width, in_width, UPCAST=_interpreting(), BLOCK_M=16,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out.view(*x.shape[:-1], out_width)
