"""Routed-expert compute: tokens sorted by expert, one GLU per expert.

Two interchangeable paths, held equal by tests/ops/test_moe_ops.py:
- `experts_loop`: a Python loop over experts (CPU, and the oracle);
- `experts_grouped_mm`: one grouped GEMM per projection (torch._grouped_mm on CUDA).
`K3_MOE_BACKEND=loop|grouped|auto` forces one.

Shape suffixes: N routed pairs (tokens*top_k), E experts, F expert width, D expert input width.
"""

from __future__ import annotations

import os

import torch

from k3.layers.mlp import glu_activation


def experts_loop(x_ND: torch.Tensor, counts_E: list[int], w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                 w2_EDF: torch.Tensor, act: str, betas: tuple[float, float]) -> torch.Tensor:
    out = []
    start = 0
    for e, n in enumerate(counts_E):
        if n == 0:
            continue
        xe = x_ND[start:start + n]
        h = glu_activation(xe @ w1_EFD[e].t(), xe @ w3_EFD[e].t(), act, *betas)
        out.append(h @ w2_EDF[e].t())
        start += n
    return torch.cat(out) if out else x_ND.new_zeros(0, w2_EDF.shape[1])


def experts_grouped_mm(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                       w2_EDF: torch.Tensor, act: str, betas: tuple[float, float]) -> torch.Tensor:
    offsets = torch.cumsum(counts_E.to(torch.int32), 0).to(torch.int32)
    dtype = x_ND.dtype
    gate = torch._grouped_mm(x_ND, w1_EFD.to(dtype).transpose(1, 2), offs=offsets)
    up = torch._grouped_mm(x_ND, w3_EFD.to(dtype).transpose(1, 2), offs=offsets)
    h = glu_activation(gate, up, act, *betas).to(dtype)
    return torch._grouped_mm(h, w2_EDF.to(dtype).transpose(1, 2), offs=offsets)


def _grouped_available(x: torch.Tensor) -> bool:
    return x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16


def run_experts(x_ND: torch.Tensor, counts_E: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                w2_EDF: torch.Tensor, act: str, betas: tuple[float, float]) -> torch.Tensor:
    """x_ND sorted by expert, counts_E [E] int tokens per expert -> [N, D]."""
    backend = os.environ.get("K3_MOE_BACKEND", "auto")
    if backend not in ("auto", "loop", "grouped"):
        raise ValueError(f"K3_MOE_BACKEND={backend!r}; use auto, loop or grouped")
    if backend == "grouped" or (backend == "auto" and _grouped_available(x_ND)):
        return experts_grouped_mm(x_ND, counts_E, w1_EFD, w3_EFD, w2_EDF, act, betas)
    return experts_loop(x_ND, counts_E.tolist(), w1_EFD, w3_EFD, w2_EDF, act, betas)
