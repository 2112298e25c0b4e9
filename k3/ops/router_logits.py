"""The router's fp32 logits x @ W^T, with bf16 tensor-core GEMMs where x and W are both bf16 (CUDA).

The router scores in fp32 (SPEC: sigmoid over fp32 logits). The plain form, x.float() @ W.float().t(), casts the
hidden states to an fp32 copy and runs an fp32 SIMT GEMM forward and both backward GEMMs the same way. When x and
W are both bf16 every product x_d * w_d is exact in fp32, so a bf16 GEMM that accumulates in fp32 and writes fp32
(`torch.mm(..., out_dtype=torch.float32)`) gives the plain logits up to the order of the fp32 sum. Backward,
dlogits (fp32) is rounded to bf16 once for the two gradient GEMMs (fp32 accumulation, as autograd of a bf16
matmul does): x's gradient ends in bf16 either way, W's in W's dtype.

Measured on one H200 (`small`, 16,384 tokens x 64 experts x 1024, one training step over 15 MoE layers, round
fourteen's kernel table): the plain form cost 2.6 ms of GEMMs plus 1.1 ms of casts.

Paths (K3_ROUTER_LOGITS, read per call): "auto" takes the bf16 GEMMs on CUDA when x and W are bf16 and the plain
form otherwise; "torch" (old name "fp32") forces the plain form. The plain form is the twin: tests/ops/test_router_logits.py holds
the two equal (on CUDA; the autograd wiring through an emulation of the bf16 GEMMs on CPU).
"""

from __future__ import annotations

import torch

from k3 import kernels

def router_logits_path() -> str:
    """K3_ROUTER_LOGITS: "auto" or "torch" (fp32 logits; `fp32` is its old name)."""
    return kernels.choice("router_logits")


def bf16_gemms_apply(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> bool:
    """Whether router_logits takes the bf16 GEMMs for these operands."""
    return (router_logits_path() == "auto" and x_TD.is_cuda and x_TD.dtype == torch.bfloat16
            and weight_ED.dtype == torch.bfloat16 and x_TD.dim() == 2)


def plain_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    return x_TD.float() @ weight_ED.float().t()


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 operands, accumulated and returned in fp32. On CPU (no `mm.dtype` kernel) the same
    products and fp32 sums through fp32 copies, so that tests can run the autograd wiring there."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _RouterLogitsBF16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, weight_ED)
        return _mm_fp32_out(x_TD, weight_ED.t())

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):
        x_TD, weight_ED = ctx.saved_tensors
        grad_TE = grad_TE.to(torch.bfloat16)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_TE @ weight_ED) if grad_TE.is_cuda else (grad_TE.float() @ weight_ED.float()).bfloat16()
        if ctx.needs_input_grad[1]:
            grad_w = _mm_fp32_out(grad_TE.t(), x_TD).to(weight_ED.dtype)
        return grad_x, grad_w


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, emulate: bool = False) -> torch.Tensor:
    """x [T, D], W [E, D] -> fp32 logits [T, E]. emulate=True runs the bf16-GEMM path on any device (tests)."""
    if emulate or bf16_gemms_apply(x_TD, weight_ED):
        return _RouterLogitsBF16.apply(x_TD, weight_ED)
    return plain_logits(x_TD, weight_ED)
