"""One AdamW step of one tensor as one Triton kernel (k3.ops.adamw_triton_kernels), at the memory floor.

Why: torch's fused AdamW (`torch.optim.AdamW(fused=True)`) took 8.85 ms a training step for `small`'s 1.73B bf16
parameters and bf16 moments on one H200, in 84 multi_tensor_apply launches: 24.3 GB read and written (14 bytes a
parameter) at 2.7 TB/s, where the GPU copies at ~4.3 TB/s (~5.7 ms). 1.51B of those parameters are routed-expert
weights in a few large tensors, and one flat kernel a tensor streams each of those at the copy rate.

The math is torch's AdamW in the order of its fused CUDA kernel (ATen's fused_adam_utils.cuh), each tensor rounded
once to its storage dtype at the end. The bias corrections are fp64, rounded to fp32 where torch rounds them; the
element math is fp32, where torch's fused kernel takes the weight decay and the moments' blends in fp64 (its
scalars are doubles, and C++ promotes): a result within an fp32 rounding or two of torch's fused one, so a bf16
one equal to it or one bf16 ulp off (where the two straddle a rounding boundary). Against torch's single-tensor
AdamW on fp32 values, likewise (its order differs only in rounding: exp_avg.lerp_). The step
count is read on the device, so a step needs no host sync and can be captured in a CUDA graph (torch's
capturable=True then holds the counts on the device); lr is a launch argument, so a replay takes the lr of its
capture, as torch's fused kernel does with a float lr.

k3.train.optim.SplitAdamW sends the large tensors here and the rest through torch's own path; its PyTorch twin is
torch.optim.AdamW, held equal by tests/train/test_adamw_triton.py (through Triton's CPU interpreter,
TRITON_INTERPRET=1, on CPU).
"""

from __future__ import annotations

import torch

from k3.ops.triton_support import interpreting, kernel_module, runs_kernels_on, triton_available

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 2048 elements a program at 4 warps: 16 of each tensor a thread. bench/adamw.py --blocks on one H100, the largest
# `small` tensor (33.5M elements, floor 0.159 ms): 0.194 ms (1.22x the floor) against 0.213 at 4096 x 8 warps,
# 0.212-0.214 at 1024 and 0.243-0.268 at 8192.
BLOCK = 2048
NUM_WARPS = 4


def kernels(interpret: bool):
    return kernel_module("k3.ops.adamw_triton_kernels", interpret)


def adamw_input_problem(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        step_tensor: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors, or None when it can. The optimizer routes on it (a tensor with a
    problem goes through torch's AdamW); adamw_step_triton raises it."""
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in named.items():
        if t.dtype not in DTYPES:
            return f"{name} is {t.dtype}; the kernel takes {DTYPES} (torch.optim.AdamW takes any)"
        if not t.is_contiguous():
            return (f"{name} {tuple(t.shape)} has strides {t.stride()}; the kernel reads flat contiguous tensors "
                    "(pass .contiguous() copies, or use torch.optim.AdamW)")
        if t.numel() != param.numel():
            return f"{name} has {t.numel()} elements and param {param.numel()}; the four tensors must match"
        if t.device != param.device:
            return f"{name} is on {t.device} and param on {param.device}; the four tensors must share a device"
    if step_tensor.numel() != 1 or step_tensor.device != param.device:
        return (f"step_tensor is {tuple(step_tensor.shape)} on {step_tensor.device}; the kernel reads one count on "
                f"param's device {param.device} (torch's AdamW keeps it there with fused=True or capturable=True)")
    if not triton_available():
        return "triton is not importable; use torch.optim.AdamW"
    if not runs_kernels_on(param.device):
        return (f"param is on {param.device}; Triton runs on CUDA, or on the CPU in its interpreter "
                "(TRITON_INTERPRET=1)")
    return None


def adamw_step_triton(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      step_tensor: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, maximize: bool = False, block: int = BLOCK,
                      num_warps: int = NUM_WARPS) -> None:
    """Update param, exp_avg and exp_avg_sq in place by one AdamW step (decoupled weight decay).

    param, grad, exp_avg, exp_avg_sq: contiguous, one shape (any), one device, each fp32, bf16 or fp16 (each read
    and written in its own dtype). step_tensor: one element on param's device holding the count of this step, 1
    for the first: torch's state["step"] after its increment (this function does not increment it). Its value
    is read as a whole number. lr, betas, eps, weight_decay: Python floats, used as doubles. `block` and
    `num_warps` are the benchmark's to sweep."""
    problem = adamw_input_problem(param, grad, exp_avg, exp_avg_sq, step_tensor)
    if problem is not None:
        raise ValueError(problem)
    if isinstance(lr, torch.Tensor):
        raise ValueError("lr is a tensor; the kernel takes a Python float (torch.optim.AdamW takes a tensor lr)")
    launch_adamw_step(param, grad, exp_avg, exp_avg_sq, step_tensor, lr, beta1, beta2, eps, weight_decay,
                      maximize, block, num_warps)


def launch_adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      step_tensor: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, maximize: bool = False, block: int = BLOCK,
                      num_warps: int = NUM_WARPS) -> None:
    """adamw_step_triton without its checks, for a caller that has run adamw_input_problem on these tensors
    (SplitAdamW routes on it): the checks cost the host microseconds a tensor, and a `small` step launches 163."""
    numel = param.numel()
    if numel == 0:
        return
    kernels(interpreting()).adamw_step[(-(-numel // block),)](
        param, grad, exp_avg, exp_avg_sq, step_tensor, numel, float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), DECAY=weight_decay != 0, MAXIMIZE=bool(maximize), BLOCK=block, num_warps=num_warps)
