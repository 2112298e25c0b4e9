"""RMSNorm and KDA's gated RMSNorm: fla's fused Triton kernels on CUDA, PyTorch twins elsewhere.

    rms_norm(x, w)          = x / rms(x) * w
    rms_norm_gated(x, g, w) = x / rms(x) * w * sigmoid(g)      (KDA's output norm, per head)

Statistics in fp32 (fp64 stays fp64), the result in x's dtype. Eager PyTorch spends five to seven elementwise
kernels on each (upcast, square, mean, rsqrt, scale, gate, downcast) and keeps their fp32 intermediates for the
backward; fla does each in one kernel forward and one backward, reading x once.

Backend: `set_norm_backend(name)` if called (None resets), else the env var K3_NORM_BACKEND, else "auto"
(fla for CUDA tensors in fp16/bf16/fp32 when `fla.modules` imports, PyTorch otherwise); "torch" and "fla"
force one. The gated norm sits inside the KDA layer and follows this switch too.
"""

from __future__ import annotations

import functools
import os

import torch

_BACKENDS = ("auto", "torch", "fla")
_ENV = "K3_NORM_BACKEND"
_override: str | None = None


@functools.lru_cache(maxsize=1)
def _load_fla_norms():
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm
    except Exception as exc:  # a broken triton install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return rms_norm, rms_norm_gated


def set_norm_backend(name: str | None) -> None:
    """Force "auto", "torch" or "fla"; None goes back to K3_NORM_BACKEND (default "auto")."""
    global _override
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"set_norm_backend(name) must be one of {_BACKENDS}, got {name!r}")
    if name == "fla" and isinstance(_load_fla_norms(), str):
        raise RuntimeError(f"norm backend 'fla' requested but fla is not importable ({_load_fla_norms()})")
    _override = name


def norm_backend(x: torch.Tensor | None = None) -> str:
    """Without x: the configured backend. With x: what a call on x runs, "fla" or "torch"."""
    name = _override if _override is not None else os.environ.get(_ENV, "auto").strip().lower()
    if name not in _BACKENDS:
        raise ValueError(f"{_ENV} must be one of {_BACKENDS}, got {name!r}")
    if x is None or name == "torch":
        return name
    usable = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32) \
        and not isinstance(_load_fla_norms(), str)
    if name == "fla" and not usable:
        raise RuntimeError(f"norm backend 'fla' forced but it cannot run on {x.device} / {x.dtype} "
                           f"(fla needs CUDA fp16/bf16/fp32 tensors); set {_ENV}=auto or torch")
    return "fla" if usable else "torch"


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
    if norm_backend(x) == "fla":
        return _load_fla_norms()[0](x, weight, None, eps=eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * sigmoid(gate) over the last dimension (x, gate [..., D], weight [D]); x's dtype out."""
    if norm_backend(x) == "fla":
        return _load_fla_norms()[1](x, gate.to(x.dtype), weight, None, activation="sigmoid", eps=eps)
    return rms_norm_gated_torch(x, gate, weight, eps)
