"""RMSNorm and KDA's gated RMSNorm: fla's fused Triton kernels on CUDA, PyTorch twins elsewhere.

    rms_norm(x, w)          = x / rms(x) * w
    rms_norm_gated(x, g, w) = x / rms(x) * w * sigmoid(g)      (KDA's output norm, per head)

Statistics in fp32 (fp64 stays fp64), the result in x's dtype. Eager PyTorch spends five to seven elementwise
kernels on each (upcast, square, mean, rsqrt, scale, gate, downcast) and keeps their fp32 intermediates for the
backward; fla does each in one kernel forward and one backward, reading x once.

Which runs follows k3.ops.fused_backend (K3_FUSED_BACKEND: fla on CUDA when it imports, else PyTorch).
"""

from __future__ import annotations

import functools

import torch

from k3.ops.fused_backend import fused_backend


@functools.lru_cache(maxsize=1)
def _load_fla_norms():
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm
    except Exception as exc:  # a broken triton install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return rms_norm, rms_norm_gated


def _use_fla(x: torch.Tensor) -> bool:
    return fused_backend(x, available=not isinstance(_load_fla_norms(), str)) == "fla"


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision inputs; fp64 stays fp64 (parity tests run in double)."""
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(compute_dtype(x))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight.to(x.dtype)).to(dtype)


def rms_norm_gated_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(compute_dtype(x))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)
    return (x * torch.sigmoid(gate.to(x.dtype))).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (x [..., D], weight [D])."""
    if _use_fla(x):
        return _load_fla_norms()[0](x, weight, None, eps=eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * sigmoid(gate) over the last dimension (x, gate [..., D], weight [D]); x's dtype out."""
    if _use_fla(x):
        return _load_fla_norms()[1](x, gate.to(x.dtype), weight, None, activation="sigmoid", eps=eps)
    return rms_norm_gated_torch(x, gate, weight, eps)
