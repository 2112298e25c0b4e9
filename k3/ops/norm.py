"""RMSNorm and KDA's gated RMSNorm: fused Triton kernels on CUDA (k3's and fla's), PyTorch twins elsewhere.

    rms_norm(x, w)          = x / rms(x) * w
    rms_norm_gated(x, g, w) = x / rms(x) * w * sigmoid(g)      (KDA's output norm, per head)

Statistics in fp32 (fp64 stays fp64), the result in x's dtype. Eager PyTorch spends five to seven elementwise
kernels on each (upcast, square, mean, rsqrt, scale, gate, downcast) and keeps their fp32 intermediates for the
backward; fla does each in one kernel forward and one backward, reading x once.

Which runs follows k3.ops.fused_backend (K3_FUSED_BACKEND: fla on CUDA when it imports, else PyTorch). Under
torch.compile without autograd (a compiled decode step) auto takes the twin: Inductor turns it into one reduction
kernel fused with its neighbours (the residual add before it, the cast after it), where fla's kernel would be an
opaque launch of its own. At batch 1 on one H200 each fla norm cost 2-3 us of kernel time, 68 of them per `small`
step (160 us), and the step went 1.69 -> 1.54 ms without them. K3_FUSED_BACKEND=fla keeps fla's kernel there too,
as a k3:: custom op.

K3_RMS_NORM picks rms_norm's kernels: "auto" (the default, also when unset or empty) sends CUDA tensors in
fp32/bf16/fp16 to k3's own kernels (k3.ops.rms_norm_triton) and everything else down the path above; "fla"
keeps the path above for CUDA tensors too, as does K3_FUSED_BACKEND=torch; "torch" takes the twin for every
norm (fla's kernels included); "triton" forces k3's kernels, also
for CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, the tests). Calls inside torch.compile always
take the path above. Why k3's kernels: in `small`'s training step on one H200 (16,384 tokens, D 1024, bf16)
fla's RMSNorm backward took 9.3 ms of GPU time over 56 calls (~170 us each against ~25 us for its 96 MB at
4 TB/s) and ~430 us of host time a call under the profiler. Measured on one H200 (bench/rms_norm.py, 16,384
rows, forward + backward): 0.040 / 0.058 / 0.128 ms against fla's 0.286 / 0.125 / 0.184 ms at D = 512 / 1024 /
2304; the `small` step 299 ms against 316 (bench/train.py, -triton-norm, one process). A kernel variant Triton
cannot compile falls back to the path above. KDA's gated norm (rms_norm_gated) runs the same kernels with the gate
fused in: under "auto" for calls without autograd (prefill, eval), under "triton" for every call; training under
"auto" keeps fla's gated norm until the kernels are timed in a training step on a GPU. Why: fla's gated norm
autotunes per bucket of 65,536 rows, so long calls without autograd took the eager twin here, which made k3's KDA
layer forward 37% slower than fla's at B=4, T=8K on one H100 (11.3 ms against 8.3; 8.3 with autograd on).
"""

from __future__ import annotations

import functools

import torch

from k3 import kernels
from k3.ops.compile_constant import assume_constant_result
from k3.ops.fused_backend import fused_backend, opaque_under_compile, with_torch_fallback
from k3.ops.rms_norm_triton import DTYPES as TRITON_DTYPES, rms_norm_triton
from k3.ops.triton_support import runs_kernels_on, triton_importable


@functools.lru_cache(maxsize=1)
def _load_fla_norms():
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm
    except Exception as exc:  # a broken triton install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return rms_norm, rms_norm_gated


@assume_constant_result
def fla_norms_available() -> bool:
    """A constant to torch.compile: traced, the import would break the graph wherever fla is missing."""
    return not isinstance(_load_fla_norms(), str)


# fla compiles and autotunes (9 configs) its norm kernels for rows of D <= 512 once per bucket of rows: 2,048
# rows for rms_norm, 65,536 for the gated norm (the kernels' NB). Training and decode see a few fixed row
# counts, but prefill sees every one (chunks, last chunks, batch sizes), so `k3 eval` spent minutes autotuning
# and, at D=512 on one H200 (Triton 3.6), hit a config that crashes Triton's compiler. Beyond one bucket
# without autograd the PyTorch twin runs instead: memory-bound, small next to the rest of a long prefill chunk.
RMS_NORM_BUCKET_ROWS = 2048
GATED_NORM_BUCKET_ROWS = 65536


def _use_fla(x: torch.Tensor, bucket_rows: int, *tensors: torch.Tensor) -> bool:
    if rms_norm_choice() == "torch":
        return False
    if fused_backend(x, available=fla_norms_available()) != "fla":
        return False
    if opaque_under_compile(x, *tensors) and fused_backend() != "fla":
        return False  # auto under compile without autograd: Inductor fuses the twin (module docstring)
    return fla_row_count_ok(x, bucket_rows)


def fla_row_count_ok(x: torch.Tensor, bucket_rows: int) -> bool:
    """Whether fla's kernel may take x's row count (see above): wide rows, one bucket, or a training step."""
    width = x.shape[-1]
    rows = x.numel() // max(width, 1)
    return width > 512 or rows <= bucket_rows or (torch.is_grad_enabled() and x.requires_grad)


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


def rms_norm_choice() -> str:
    """K3_RMS_NORM: "auto" (also when unset or empty), "torch", "triton" or "fla" (module docstring)."""
    return kernels.choice("rms_norm")


def k3_triton_path(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """"forced" or "chosen" when rms_norm on (x, weight) runs k3's Triton kernels, else None."""
    if torch.compiler.is_compiling():  # traced calls keep the fla / twin path (module docstring)
        return None
    if x.dtype not in TRITON_DTYPES or weight.dtype not in TRITON_DTYPES:
        return None
    choice = rms_norm_choice()
    if choice == "triton":
        return "forced" if runs_kernels_on(x.device) else None
    # K3_FUSED_BACKEND=torch (the twins, e.g. bench/gpu_check's reference runs) keeps the twin here too.
    if choice == "auto" and x.is_cuda and fused_backend() != "torch" and triton_importable():
        return "chosen"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (x [..., D], weight [D])."""
    path = k3_triton_path(x, weight)
    if path == "forced":
        return rms_norm_triton(x, weight, eps)
    if path == "chosen":  # a kernel variant Triton cannot compile here takes the path below from then on
        return with_torch_fallback(("rms_norm_triton", x.shape[-1], x.dtype, weight.dtype),
                                   lambda: rms_norm_triton(x, weight, eps), lambda: _rms_norm_untriton(x, weight, eps))
    return _rms_norm_untriton(x, weight, eps)


def _rms_norm_untriton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_fla(x, RMS_NORM_BUCKET_ROWS, weight):
        if opaque_under_compile(x, weight):
            return fla_rms_norm_op(x, weight, eps)
        return rms_norm_fla(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * sigmoid(gate) over the last dimension (x, gate [..., D], weight [D]); x's dtype out."""
    path = k3_triton_path(x, weight) if gate.dtype in TRITON_DTYPES else None
    if path == "chosen" and torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate, weight)):
        # Training keeps fla's gated norm under auto until k3's gated kernels are timed in the training step on a
        # GPU (bench/train.py -triton-norm forces them); without autograd the alternative was the eager twin.
        path = None
    if path == "forced":
        return rms_norm_triton(x, weight, eps, gate=gate)
    if path == "chosen":
        return with_torch_fallback(("rms_norm_gated_triton", x.shape[-1], x.dtype, gate.dtype, weight.dtype),
                                   lambda: rms_norm_triton(x, weight, eps, gate=gate),
                                   lambda: _rms_norm_gated_untriton(x, gate, weight, eps))
    return _rms_norm_gated_untriton(x, gate, weight, eps)


def _rms_norm_gated_untriton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_fla(x, GATED_NORM_BUCKET_ROWS, gate, weight):
        if opaque_under_compile(x, gate, weight):
            return fla_rms_norm_gated_op(x, gate, weight, eps)
        return _rms_norm_gated_fla(x, gate, weight, eps)
    return rms_norm_gated_torch(x, gate, weight, eps)


def rms_norm_fla(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return with_torch_fallback(("rms_norm", x.shape[-1], x.dtype),
                               lambda: _load_fla_norms()[0](x, weight, None, eps=eps),
                               lambda: rms_norm_torch(x, weight, eps))


def _rms_norm_gated_fla(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return with_torch_fallback(("rms_norm_gated", x.shape[-1], x.dtype),
                               lambda: _load_fla_norms()[1](x, gate.to(x.dtype), weight, None,
                                                            activation="sigmoid", eps=eps),
                               lambda: rms_norm_gated_torch(x, gate, weight, eps))


# The no-autograd fla calls as custom ops, opaque to torch.compile (k3.ops.fused_backend.opaque_under_compile):
# the result is x-shaped, contiguous, in x's dtype, from fla or from the twin after a Triton compile failure.
@torch.library.custom_op("k3::fla_rms_norm", mutates_args=())
def fla_rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_fla(x, weight, eps).contiguous()


@fla_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("k3::fla_rms_norm_gated", mutates_args=())
def fla_rms_norm_gated_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_gated_fla(x, gate, weight, eps).contiguous()


@fla_rms_norm_gated_op.register_fake
def _(x, gate, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
