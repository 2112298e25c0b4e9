"""The last steps of a [D] weight's gradient in k3's row kernels, as one launch: the sum over the per-program
partial rows a backward kernel leaves ([P, D] fp32), times one or two [D] vectors, cast to the weights' dtypes.

RMSNorm's backward ends in dw_PD.sum(0).to(w.dtype) (2 launches); an AttnRes mix's backward in dq_PD.sum(0),
then (dq * query.float()).to(...) and (dq * norm_weight.float()).to(...) (7), and its forward starts with
norm_weight.float() * query.float() (3). Each becomes one kernel under the switch `vector_grads` = "triton"
(k3.kernels); "torch" (the default) keeps those PyTorch ops, the twin. The kernel sums the partial rows in fp32 in
an order of its own (tiles of rows); PyTorch's sum(0) may add them in another, so the two differ in the last bits.

    s_D = partials_PD.sum(0)                        summed_rows(partials_PD, dtype)
    (s_D * a_D, s_D * b_D) in their dtypes          summed_rows_times(partials_PD, a_D, b_D, dtype_a, dtype_b)
"""

from __future__ import annotations

import torch

from k3 import kernels
from k3.ops.triton_support import interpreting, kernel_module, runs_kernels_on

# Columns a program and partial rows a load: 16 programs at D = 1024 (`small`), each reading [32, 64] tiles.
BLOCK_D = 64
BLOCK_R = 32


def vector_grads_backend() -> str:
    """The switch `vector_grads` (K3_VECTOR_GRADS): "triton" or "torch"."""
    return kernels.choice("vector_grads")


def triton_chosen(x: torch.Tensor) -> bool:
    """Whether the kernel runs for tensors like x: chosen, on CUDA or in Triton's CPU interpreter."""
    return vector_grads_backend() == "triton" and runs_kernels_on(x.device)


def _launch(partials_PD: torch.Tensor, a_D: torch.Tensor | None, b_D: torch.Tensor | None,
            dtype_a: torch.dtype, dtype_b: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    import triton

    num_rows, dim = partials_PD.shape
    if partials_PD.stride() != (dim, 1):
        partials_PD = partials_PD.contiguous()
    out_a = torch.empty(dim, dtype=dtype_a, device=partials_PD.device)
    out_b = torch.empty(dim, dtype=dtype_b, device=partials_PD.device) if b_D is not None else None
    if dim:
        kernel = kernel_module("k3.ops.vector_grads_triton_kernels", interpreting()).summed_rows_times
        kernel[(triton.cdiv(dim, BLOCK_D),)](
            partials_PD, a_D if a_D is not None else out_a, b_D if b_D is not None else out_a, out_a,
            out_b if out_b is not None else out_a, num_rows, dim, SCALED=a_D is not None, TWO=b_D is not None,
            BLOCK_D=BLOCK_D, BLOCK_R=BLOCK_R)
    return out_a, out_b


def _check(partials_PD: torch.Tensor, *vectors: torch.Tensor) -> None:
    if partials_PD.dim() != 2:
        raise ValueError(f"partials must be [P, D], got {tuple(partials_PD.shape)}")
    for v in vectors:
        if v.shape != (partials_PD.shape[1],) or v.device != partials_PD.device:
            raise ValueError(f"a vector is {tuple(v.shape)} on {v.device}; it must be [{partials_PD.shape[1]}] "
                             f"on {partials_PD.device}, like a row of the partials")


def summed_rows(partials_PD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partials [P, D] -> their sum over P [D] (fp32 sum) in dtype."""
    _check(partials_PD)
    if triton_chosen(partials_PD):
        return _launch(partials_PD, None, None, dtype, None)[0]
    return partials_PD.sum(0).to(dtype)


def summed_rows_times(partials_PD: torch.Tensor, a_D: torch.Tensor, b_D: torch.Tensor, dtype_a: torch.dtype,
                      dtype_b: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """partials [P, D], a and b [D] -> (s * a in dtype_a, s * b in dtype_b), s = the fp32 sum over P, a and b
    taken in fp32."""
    _check(partials_PD, a_D, b_D)
    if triton_chosen(partials_PD):
        return _launch(partials_PD, a_D, b_D, dtype_a, dtype_b)
    total_D = partials_PD.sum(0)
    return (total_D * a_D.float()).to(dtype_a), (total_D * b_D.float()).to(dtype_b)


def product(a_D: torch.Tensor, b_D: torch.Tensor) -> torch.Tensor:
    """a [D] * b [D] in fp32 (each taken in fp32): the one-row case of summed_rows_times."""
    _check(a_D[None], b_D)
    if triton_chosen(a_D):
        return _launch(a_D[None], b_D, None, torch.float32, None)[0]
    return a_D.float() * b_D.float()
