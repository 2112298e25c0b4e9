"""AdamW on fp32 master weights of bf16 parameters in one pass: each element's bf16 gradient read (times the clip
coefficient), its fp32 master and both fp32 moments updated, and the master written back rounded into the bf16
parameter, for a whole list of tensors in one Triton launch (k3.ops.master_adamw_kernels).

Why: the master-weight step it replaces (k3.train.master_weights with K3_MASTER_ADAMW=torch) copies every bf16
gradient into an fp32 one (6 bytes a parameter), clips in fp32 (read 4, read and write 8), runs AdamW over the
masters (28), then copies the masters into the parameters (6): 52 bytes a parameter, 90 GB a step for `small`'s
1.73B. This step reads the bf16 gradient twice (2 bytes for the clip's norm, then in the kernel, which moves 28:
the gradient read, master and moments read and written, the parameter written): 30 in all, 52 GB, and the 6.9 GB
of fp32 gradient buffers are never allocated. On one H100 `k3 train`'s `small` step took 155.4 ms with it against
171.7 with the torch path (BENCHMARKS.md); it is the CUDA default (K3_MASTER_ADAMW=auto).

The math is k3.ops.adamw_triton's (torch's fused AdamW order, bias corrections in fp64 from the step count on the
device, fp32 element math, IEEE square roots and divisions), compiled without FMA contraction so that every
operation rounds as its PyTorch twin's (master_adamw_step_torch, which the tests hold equal to the kernel, in
Triton's CPU interpreter without a GPU; bench/gpu_check.py and bench/master_adamw.py check it on a GPU): a result
equal to the twin, and within an fp32 rounding or two of torch.optim.AdamW on the masters.

Tensors the kernel cannot take (another dtype, not contiguous, a step count elsewhere, storage not 16-byte
aligned) are stepped by the twin, the same arithmetic one tensor at a time.
"""

from __future__ import annotations

import math
import struct

import torch

from k3.ops.triton_support import interpreting, kernel_module, runs_kernels_on, triton_available

PARAM_DTYPES = (torch.bfloat16, torch.float16)
TABLE_COLUMNS = ("param", "grad", "master", "exp_avg", "exp_avg_sq", "step", "numel")
# 2048 elements a program at 4 warps, as k3.ops.adamw_triton's kernel (its sweep on one H100 chose them).
BLOCK = 2048
NUM_WARPS = 4
ALIGNMENT = 16  # bytes: the kernel's 16-byte accesses assume it (see _offset there)


def kernels(interpret: bool):
    return kernel_module("k3.ops.master_adamw_kernels", interpret)


def fused_available(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: CUDA with triton, or the CPU in Triton's interpreter."""
    return triton_available() and runs_kernels_on(device)


def tensor_problem(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, step: torch.Tensor) -> str | None:
    """Why the kernel cannot take this tensor's step, or None when it can (the twin then takes it)."""
    if param.dtype not in PARAM_DTYPES or grad.dtype != param.dtype:
        return f"param {param.dtype} / grad {grad.dtype}; the kernel takes {PARAM_DTYPES}, the grad in the param's"
    named = {"param": param, "grad": grad, "master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in named.items():
        if name not in ("param", "grad") and t.dtype != torch.float32:
            return f"{name} is {t.dtype}; the kernel keeps masters and moments in fp32"
        if not t.is_contiguous() or t.numel() != param.numel() or t.device != param.device:
            return f"{name} is not contiguous, has another size or lies on another device than param"
        if t.data_ptr() % ALIGNMENT:
            return f"{name}'s storage is not {ALIGNMENT}-byte aligned"
    if step.numel() != 1 or step.dtype != torch.float32 or step.device != param.device or step.data_ptr() % 4:
        return f"step is {step.dtype} on {step.device}; the kernel reads one fp32 count on param's device"
    return None


class MultiTensorTables:
    """The kernel's table and block map for one list of tensors, kept on the device between steps and rebuilt only
    when an address or a size changes (a graphed step's gradients are the same buffers every step).

    table: int64 [tensors, len(TABLE_COLUMNS)] (element offsets, then the size); blocks: int32 [programs, 2],
    (tensor index, block within it)."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.rows: list[int] | None = None
        self.numels: list[int] | None = None
        self.table: torch.Tensor | None = None
        self.blocks: torch.Tensor | None = None

    def update(self, rows: list[int], numels: list[int], device: torch.device) -> int:
        """Tables for `rows` (the flat table) and `numels`; returns the number of programs."""
        if rows != self.rows:
            self.table = _to_device(torch.tensor(rows, dtype=torch.int64), device)
            self.rows = rows
        if numels != self.numels:
            counts = [-(-n // self.block) for n in numels]
            total = sum(counts)
            counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
            tensor_ids = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t,
                                                 output_size=total)
            starts = torch.cumsum(counts_t, 0) - counts_t
            ordinal = torch.arange(total, device=device) - starts[tensor_ids]
            self.blocks = torch.stack([tensor_ids, ordinal], dim=1).to(torch.int32).contiguous()
            self.numels = numels
        return self.blocks.shape[0]


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host on `device` without a host sync (a pinned staging copy; torch's host allocator keeps it alive until the
    copy has run)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def master_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], masters: list[torch.Tensor],
                      exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool = False,
                      grad_scale: torch.Tensor | None = None, tables: MultiTensorTables | None = None,
                      block: int = BLOCK, num_warps: int = NUM_WARPS) -> int:
    """One AdamW step of every master from its parameter's gradient, the parameter rewritten as the master rounded.

    params, grads: bf16 (or fp16) tensors, each grad its param's shape; masters, exp_avgs, exp_avg_sqs: fp32 of the
    same shapes; steps: each tensor's one-element fp32 count of this step (already incremented: 1 at the first).
    grad_scale: a one-element fp32 tensor multiplying every gradient (the clip coefficient), None for 1. lr and the
    rest: Python floats. tables: reused between calls over the same list (a new one each call otherwise).
    Returns how many tensors the kernel took (the rest went through master_adamw_step_torch)."""
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr is a tensor; the fused master step takes a Python float")
    lists = (params, grads, masters, exp_avgs, exp_avg_sqs, steps)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"the six lists must have one length each; got {[len(x) for x in lists]}")
    if not params:
        return 0
    device = params[0].device
    fused = fused_available(device)
    kernel_items, twin_items = [], []
    for item in zip(*lists):
        takes = fused and item[0].device == device and tensor_problem(*item) is None
        (kernel_items if takes else twin_items).append(item)
    if twin_items:
        master_adamw_step_torch(*map(list, zip(*twin_items)), lr, beta1, beta2, eps, weight_decay, maximize,
                                grad_scale)
    if not kernel_items:
        return 0
    param_dtypes = {item[0].dtype for item in kernel_items}
    if len(param_dtypes) > 1:  # one launch per parameter dtype (bf16 and fp16 mixed: rare)
        return sum(master_adamw_step(*map(list, zip(*[i for i in kernel_items if i[0].dtype == dtype])), lr, beta1,
                                     beta2, eps, weight_decay, maximize, grad_scale, None, block, num_warps)
                   for dtype in param_dtypes)
    # Element offsets from the first tensor's parameter (bf16) and master (fp32): see the kernel module.
    param_base, master_base = kernel_items[0][0], kernel_items[0][2]
    param_at, master_at = param_base.data_ptr(), master_base.data_ptr()
    half, single = param_base.element_size(), master_base.element_size()
    rows, numels = [], []
    for param, grad, master, exp_avg, exp_avg_sq, step in kernel_items:
        rows += [(param.data_ptr() - param_at) // half, (grad.data_ptr() - param_at) // half,
                 (master.data_ptr() - master_at) // single, (exp_avg.data_ptr() - master_at) // single,
                 (exp_avg_sq.data_ptr() - master_at) // single, (step.data_ptr() - master_at) // single,
                 param.numel()]
        numels.append(param.numel())
    tables = tables if tables is not None and tables.block == block else MultiTensorTables(block)
    programs = tables.update(rows, numels, device)
    if programs == 0:
        return len(kernel_items)
    if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32
                                   or grad_scale.device != device):
        raise ValueError(f"grad_scale must be one fp32 element on {device}; got {grad_scale.dtype} "
                         f"{tuple(grad_scale.shape)} on {grad_scale.device}")
    scale = grad_scale if grad_scale is not None else master_base  # any pointer: not read without HAS_SCALE
    interpret = interpreting()
    options = {} if interpret else {"enable_fp_fusion": False}  # every operation rounded, as in the twin
    kernels(interpret).master_adamw_step[(programs,)](
        tables.table, tables.blocks, scale, param_base, master_base, float(lr), float(beta1), float(beta2),
        float(eps), float(weight_decay), HAS_SCALE=grad_scale is not None, DECAY=weight_decay != 0,
        MAXIMIZE=bool(maximize), BLOCK=block, num_warps=num_warps, **options)
    return len(kernel_items)


def _f32(x: float) -> float:
    """x rounded to the nearest fp32 value (a Python float that torch's fp32 arithmetic takes exactly)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def bias_corrections(count: int, beta1: float, beta2: float) -> tuple[float, float]:
    """(1 - beta1^count, 1 - beta2^count) in fp64 by repeated squaring over the count's bits, as the kernel's
    _bias_corrections computes them (a power by squaring may differ from pow() in the last fp64 bit)."""
    power1 = power2 = 1.0
    square1, square2 = beta1, beta2
    for _ in range(31):
        if count & 1:
            power1, power2 = power1 * square1, power2 * square2
        square1, square2 = square1 * square1, square2 * square2
        count >>= 1
    return 1.0 - power1, 1.0 - power2


@torch.no_grad()
def master_adamw_step_torch(params: list[torch.Tensor], grads: list[torch.Tensor], masters: list[torch.Tensor],
                            exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                            lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                            maximize: bool = False, grad_scale: torch.Tensor | None = None) -> None:
    """The kernel's twin in plain PyTorch, one operation at a time in the kernel's order and roundings (arguments as
    master_adamw_step's). It reads the step counts on the host: a test oracle and the path of odd tensors."""
    keep1, take1, keep2, take2 = _f32(beta1), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2)
    decay, eps32 = _f32(lr * weight_decay), _f32(eps)
    counts = torch.stack([s.reshape(()).to(torch.float64).cpu() for s in steps]).tolist() if steps else []
    for param, grad, master, exp_avg, exp_avg_sq, count in zip(params, grads, masters, exp_avgs, exp_avg_sqs,
                                                                counts):
        correction1, correction2 = bias_corrections(int(count), beta1, beta2)
        step_size = _f32(lr / _f32(correction1))
        correction2_sqrt = _f32(math.sqrt(correction2))
        g = grad.to(torch.float32)
        if grad_scale is not None:
            g = g * grad_scale.to(g.device)
        if maximize:
            g = -g
        if weight_decay != 0:
            master.copy_(master - decay * master)
        exp_avg.copy_(keep1 * exp_avg + take1 * g)
        exp_avg_sq.copy_(keep2 * exp_avg_sq + (take2 * g) * g)
        # IEEE square root and division, as the kernel's: torch's fp32 sqrt on the CPU is not correctly rounded
        # (through fp64 it is: 53 bits round to 24 without a double-rounding error), and torch divides by a
        # scalar as a multiply by its reciprocal, so the divisor is a full tensor.
        root = exp_avg_sq.to(torch.float64).sqrt().to(torch.float32)
        denom = root / torch.full_like(root, correction2_sqrt) + eps32
        master.copy_(master - (step_size * exp_avg) / denom)
        param.copy_(master)
