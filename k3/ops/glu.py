"""The GLU activation of k3's feed-forward blocks and experts, with its fast paths (k3.kernels switch `glu`).

SiLU-GLU:  act(g, u) = silu(g) * u                                     (Kimi Linear)
SiTU-GLU:  act(g, u) = beta_g*tanh(g/beta_g)*sigmoid(g) * beta_u*tanh(u/beta_u)   (K3; betas 4 and 25)
SiTU is SiLU with both branches soft-capped by tanh, which keeps expert outputs bounded in low precision.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from k3 import kernels
from k3.ops.fused_backend import fused_backend, with_torch_fallback
from k3.ops.glu_triton import DTYPES as GLU_TRITON_DTYPES, KINDS as GLU_KINDS, glu_triton
from k3.ops.triton_support import triton_available

__all__ = ["GLU_KINDS", "compiled_glu", "glu_activation", "glu_backend", "glu_formula", "glu_path"]


def glu_formula(gate: torch.Tensor, up: torch.Tensor, kind: str, beta_gate: float = 4.0,
                beta_up: float = 25.0) -> torch.Tensor:
    """The activation as plain PyTorch ops (the twin, and what the compiled path compiles)."""
    if kind == "silu":
        return F.silu(gate) * up
    return (beta_gate * torch.tanh(gate / beta_gate) * torch.sigmoid(gate)) * (beta_up * torch.tanh(up / beta_up))


@functools.lru_cache(maxsize=1)
def compiled_glu():
    """glu_formula through Inductor, shapes dynamic (one graph for every row count). Forward and backward each
    become one elementwise kernel: eager SiTU runs about nine kernels forward and more backward over [N, F]
    tensors, and autograd keeps their intermediates; at `small`'s routed width (N = 98K pairs x F = 1024 in
    bf16, 200 MB a tensor) that is milliseconds per layer of pure memory traffic."""
    return torch.compile(glu_formula, dynamic=True)


_compile_failed: list[str] = []


def glu_backend() -> str:
    return kernels.choice("glu")


def glu_path(gate: torch.Tensor, up: torch.Tensor) -> str:
    """Which implementation a call takes: "triton" (k3.ops.glu_triton), "compiled" (compiled_glu) or "formula".

    K3_GLU_BACKEND=auto (the default): training on CUDA outside any compiled graph takes the Triton kernels
    (the compiled formula where triton does not import or gate and up differ in dtype), unless
    K3_FUSED_BACKEND=torch asks for the twin. Inference keeps the formula: its decode steps are CUDA graphs, or
    compiled whole (K3_COMPILE_DECODE). Inside a compiled graph Inductor fuses the formula itself, whatever the
    switch. `torch` forces the formula, `compiled` the compiled formula for every training call, `triton` the
    kernels for every call (CPU tensors through Triton's interpreter)."""
    backend = glu_backend()
    if torch.compiler.is_compiling() or backend == "torch":
        return "formula"
    if backend == "triton":
        return "triton"
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return "formula"
    if backend == "auto":
        if not gate.is_cuda or fused_backend() == "torch":
            return "formula"
        if triton_available() and gate.dtype == up.dtype and gate.dtype in GLU_TRITON_DTYPES:
            return "triton"
    return "formula" if _compile_failed else "compiled"


def glu_activation(gate: torch.Tensor, up: torch.Tensor, kind: str, beta_gate: float = 4.0,
                   beta_up: float = 25.0) -> torch.Tensor:
    if kind not in GLU_KINDS:
        raise ValueError(f"unknown GLU activation {kind!r}; use 'silu' or 'situ'")
    path = glu_path(gate, up)
    if path == "triton":  # a kernel variant Triton cannot compile runs the formula from then on
        return with_torch_fallback(("glu_triton", kind, gate.dtype, gate.shape[-1]),
                                   lambda: glu_triton(gate, up, kind, beta_gate, beta_up),
                                   lambda: glu_formula(gate, up, kind, beta_gate, beta_up))
    if path == "compiled":
        try:
            return compiled_glu()(gate, up, kind, beta_gate, beta_up)
        except Exception as exc:  # Inductor unable to build the kernel here: the twin computes the same
            _compile_failed.append(f"{type(exc).__name__}: {str(exc).strip()[:200]}")
            warnings.warn(f"the compiled GLU failed ({_compile_failed[0]}); k3 runs the PyTorch twin from now on",
                          RuntimeWarning, stacklevel=2)
    return glu_formula(gate, up, kind, beta_gate, beta_up)
