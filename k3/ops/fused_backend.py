"""One switch for fla's fused layer kernels outside the KDA recurrence: the short conv, RMSNorm and KDA's gated
RMSNorm (k3.ops.short_conv, k3.ops.norm). The recurrence itself has its own switch (k3.ops.kda).

Backend: `set_fused_backend(name)` if called (None resets), else the env var K3_FUSED_BACKEND, else "auto"
(fla for CUDA tensors in fp16/bf16/fp32 when fla imports, PyTorch otherwise); "torch" and "fla" force one.

Under torch.compile without autograd (a compiled decode step), each fla call goes through a `k3::fla_*` custom
op (`opaque_under_compile`): dynamo cannot trace fla's Python launchers, and an op keeps the kernel one opaque
call inside one graph. The op's body is the eager call, fallback to the PyTorch twin included.
"""

from __future__ import annotations

import warnings
from typing import Callable, Hashable, TypeVar

import torch

from k3 import kernels

T = TypeVar("T")

_ENV = kernels.SWITCHES["fused"].env


def set_fused_backend(name: str | None) -> None:
    """Pin "auto", "torch" or "fla" (k3.kernels.pin); None goes back to K3_FUSED_BACKEND (default "auto")."""
    kernels.pin("fused", name)


def fused_backend(x: torch.Tensor | None = None, available: bool = True) -> str:
    """Without x: the configured backend. With x: what a call on x runs, "fla" or "torch"; `available` says
    whether the caller's fla kernel imported."""
    name = kernels.choice("fused")
    if x is None or name == "torch":
        return name
    usable = available and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if name == "fla" and not usable:
        raise RuntimeError(f"fused backend 'fla' forced but it cannot run on {x.device} / {x.dtype} "
                           f"(fla needs CUDA fp16/bf16/fp32 tensors and an importable fla); "
                           f"set {_ENV}=auto or torch")
    return "fla" if usable else "torch"


def opaque_under_compile(*tensors: torch.Tensor | None) -> bool:
    """Whether an fla call takes its k3:: custom op: only while torch.compile traces, and only when no autograd
    graph is being built (the ops have no backward: training calls fla directly, compiled or not)."""
    if not torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


# Kernel variants (op, input flags) whose fla kernel Triton failed to compile; they run the PyTorch twin.
_failed: dict[Hashable, str] = {}


def is_triton_compile_failure(exc: BaseException) -> bool:
    """Triton's compiler giving up on a kernel config (an MLIR pass failing, a CompilationError), which its
    autotuner does not catch. Out-of-memory and ordinary errors are not this and must surface."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if type(exc).__name__ in ("CompilationError", "CompileTimeAssertionFailure", "MLIRCompilationError"):
        return True
    return isinstance(exc, RuntimeError) and "PassManager::run failed" in str(exc)


def with_torch_fallback(variant: Hashable, fla_call: Callable[[], T], torch_call: Callable[[], T]) -> T:
    """fla_call(), unless Triton cannot compile that kernel variant: then warn once, run torch_call() and keep
    this variant on PyTorch for the rest of the process. Seen on one H200 (Triton 3.6): while autotuning a new
    variant (an input layout first met in `k3 eval`), one config of fla's short-conv and norm kernels crashed
    Triton's compiler and took the whole run down."""
    if variant in _failed:
        return torch_call()
    try:
        return fla_call()
    except Exception as exc:
        if not is_triton_compile_failure(exc):
            raise
        _failed[variant] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        warnings.warn(f"the Triton kernel for {variant} failed to compile ({_failed[variant]}); k3 runs its "
                      "PyTorch twin for it from now on", RuntimeWarning, stacklevel=2)
        return torch_call()
