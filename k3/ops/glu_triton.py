"""The GLU activation as two Triton kernels, forward and backward (k3.ops.glu_triton_kernels).

    SiTU:  h = beta_g*tanh(g/beta_g)*sigmoid(g) * beta_u*tanh(u/beta_u)      SiLU:  h = silu(g) * u

Why: the Inductor-compiled formula (k3.ops.glu.compiled_glu, the CUDA training default before these kernels) ran
at 1.98x its bytes' time forward and 1.84x forward + backward at `small`'s routed shape (98,304 x 1024, bf16, one
H200, bench/glu.py): 0.284 / 0.702 ms, bound by its transcendentals rather than by memory. These kernels read gate
and up once (and dh, gate, up once backward, recomputing the activation), with tanh and sigmoid from exp(-|x|) (no
overflow, and 1 - tanh^2 without the cancellation near the caps), two exponentials and one approximate reciprocal
an element: 0.205 / 0.524 ms there, 1.43x / 1.37x the floor (a first version with three exponentials and three
IEEE divisions ran at the compiled formula's speed).

The forward keeps gate and up for the backward (nothing under no_grad). The PyTorch twin is
k3.ops.glu.glu_formula, held equal by tests/ops/test_glu_triton.py (through Triton's CPU interpreter,
TRITON_INTERPRET=1); k3.ops.glu picks the path (K3_GLU_BACKEND). Shape suffixes: N rows (every dim but the
last), F width.
"""

from __future__ import annotations

import math

import torch

from k3.ops.triton_support import Blocks, interpreting, kernel_module, pow2_width

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = ("silu", "situ")
# A tile of 4K elements (4 rows of F = 1024) at 8 warps: 16 values of each tensor per thread. On one H200
# (bench/glu.py --sweep) the final kernels took 0.525 ms forward + backward at the routed shape with 2 x 1024 at 4
# warps and 0.497 with 4 x 1024 at 8 (5% less at every swept shape); the first version had been slower with the
# larger tile (0.571 against 0.747 ms), when it was bound by its transcendentals.
TILE_ELEMENTS = 4096
TILE_WARPS = 8
MAX_BLOCK_F = 1024


def kernels(interpret: bool):
    return kernel_module("k3.ops.glu_triton_kernels", interpret)


def default_blocks(width: int) -> Blocks:
    block_f = min(pow2_width(width), MAX_BLOCK_F)
    return Blocks(block_n=max(1, TILE_ELEMENTS // block_f), block_d=block_f, num_warps=TILE_WARPS)


def check_glu_inputs(gate: torch.Tensor, up: torch.Tensor, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown GLU activation {kind!r}; use 'silu' or 'situ'")
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape [..., F]")
    if gate.dtype != up.dtype or gate.dtype not in DTYPES:
        raise ValueError(f"gate is {gate.dtype} and up {up.dtype}; the kernels take one dtype of {DTYPES} for "
                         "both (k3.ops.glu.glu_formula takes any)")
    if gate.device != up.device:
        raise ValueError(f"gate is on {gate.device} and up on {up.device}; they must share a device")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., F] -> [N, F] with contiguous columns: a view where the rows lie at one stride (the halves of a
    fused gate/up output do), a copy otherwise."""
    x_NF = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return x_NF if x_NF.stride(1) == 1 or x_NF.numel() == 0 else x_NF.contiguous()


def _grid(num_rows: int, width: int, blocks: Blocks) -> tuple[int, int]:
    import triton

    return (triton.cdiv(num_rows, blocks.block_n), triton.cdiv(width, blocks.block_d))


def glu_forward(gate_NF: torch.Tensor, up_NF: torch.Tensor, kind: str, beta_gate: float, beta_up: float,
                blocks: Blocks | None = None) -> torch.Tensor:
    """gate, up [N, F] (contiguous columns) -> h [N, F] contiguous, in gate's dtype."""
    num_rows, width = gate_NF.shape
    blocks = blocks or default_blocks(width)
    h_NF = torch.empty(num_rows, width, dtype=gate_NF.dtype, device=gate_NF.device)
    if h_NF.numel():
        kernels(interpreting()).glu_forward[_grid(num_rows, width, blocks)](
            gate_NF, up_NF, h_NF, num_rows, gate_NF.stride(0), up_NF.stride(0), F=width, SITU=kind == "situ",
            beta_gate=float(beta_gate), beta_up=float(beta_up), GATE_BETA_4=float(beta_gate) == 4.0,
            BLOCK_N=blocks.block_n, BLOCK_F=blocks.block_d, num_warps=blocks.num_warps)
    return h_NF


def glu_backward(dh_NF: torch.Tensor, gate_NF: torch.Tensor, up_NF: torch.Tensor, kind: str, beta_gate: float,
                 beta_up: float, blocks: Blocks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dh, gate, up [N, F] (contiguous columns) -> (dgate, dup) [N, F] contiguous, in gate's and up's dtype."""
    num_rows, width = gate_NF.shape
    blocks = blocks or default_blocks(width)
    dgate_NF = torch.empty(num_rows, width, dtype=gate_NF.dtype, device=gate_NF.device)
    dup_NF = torch.empty(num_rows, width, dtype=up_NF.dtype, device=up_NF.device)
    if dgate_NF.numel():
        kernels(interpreting()).glu_backward[_grid(num_rows, width, blocks)](
            dh_NF, gate_NF, up_NF, dgate_NF, dup_NF, num_rows, dh_NF.stride(0), gate_NF.stride(0),
            up_NF.stride(0), F=width, SITU=kind == "situ", beta_gate=float(beta_gate), beta_up=float(beta_up),
            GATE_BETA_4=float(beta_gate) == 4.0, BLOCK_N=blocks.block_n, BLOCK_F=blocks.block_d,
            num_warps=blocks.num_warps)
    return dgate_NF, dup_NF


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_NF, up_NF, kind, beta_gate, beta_up, blocks, backward_blocks):
        ctx.save_for_backward(gate_NF, up_NF)
        ctx.settings = (kind, beta_gate, beta_up, backward_blocks)
        return glu_forward(gate_NF, up_NF, kind, beta_gate, beta_up, blocks)

    @staticmethod
    def backward(ctx, dh_NF):
        gate_NF, up_NF = ctx.saved_tensors
        kind, beta_gate, beta_up, backward_blocks = ctx.settings
        dh_NF = dh_NF if dh_NF.stride(1) == 1 else dh_NF.contiguous()
        dgate_NF, dup_NF = glu_backward(dh_NF, gate_NF, up_NF, kind, beta_gate, beta_up, backward_blocks)
        return (dgate_NF if ctx.needs_input_grad[0] else None, dup_NF if ctx.needs_input_grad[1] else None,
                None, None, None, None, None)


def glu_triton(gate: torch.Tensor, up: torch.Tensor, kind: str, beta_gate: float = 4.0, beta_up: float = 25.0,
               blocks: Blocks | None = None, backward_blocks: Blocks | None = None) -> torch.Tensor:
    """Same arguments and result as k3.ops.glu.glu_formula for gate and up of one shape [..., F] and one
    dtype (fp32, bf16 or fp16): h [..., F] in that dtype, with gradients for both. `blocks` (forward) and
    `backward_blocks` are the benchmark's to sweep (default_blocks when None)."""
    check_glu_inputs(gate, up, kind)
    gate_NF, up_NF = _rows(gate), _rows(up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        h_NF = _GLU.apply(gate_NF, up_NF, kind, float(beta_gate), float(beta_up), blocks, backward_blocks)
    else:
        h_NF = glu_forward(gate_NF, up_NF, kind, beta_gate, beta_up, blocks)
    return h_NF.view(gate.shape)
