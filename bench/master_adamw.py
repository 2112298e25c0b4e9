"""The optimizer's part of a bf16-parameter training step on one GPU: the fused master-weight AdamW pass
(k3.ops.master_adamw, K3_MASTER_ADAMW=triton) against the path it replaces (K3_MASTER_ADAMW=torch: fp32 gradient
copies, clip, build_optimizer's AdamW over the fp32 masters, a copy into the bf16 parameters) and against plain
fp32 AdamW (fp32 parameters and gradients, build_optimizer), on one preset's parameter shapes, all in this run.

Usage: source .devcache/env.sh && python bench/master_adamw.py [--preset small] [--repeats 10] [--out PATH]
       [--device cuda|cpu]

(a) Check, on one tensor of each distinct shape of the preset (so every tail a block can leave), --check-steps
steps with a new lr each and the clip active: the kernel against its PyTorch twin (master_adamw_step_torch on the
GPU) must be equal bit for bit in parameters, masters and both moments (exit 1 otherwise: the kernel may be the
default only while it is), and against the torch path within fp32 roundings (the largest difference over the
values' scale is printed). Also whether torch's own fused AdamW (torch._fused_adamw_) takes fp32 parameters with
bf16 gradients, the other way to skip the gradient copy: tried on one tensor, the answer printed.
(b) Timing: clip_grad_norm_(1.0) + step() (what `k3 train` runs after the backward), CUDA events around both,
host launches included, median of --repeats after 3 untimed; every variant over the whole preset, the same
random values and bf16 gradients (fp32 AdamW: the same gradients in fp32), each built, timed and freed in turn.
Floors: the bytes each variant must move over the copy bandwidth measured here (fused: 2 bytes a parameter for
the norm's read, 28 for the pass; torch path: 6 copy + 12 clip + 28 AdamW + 6 copy back; fp32 AdamW: 12 clip +
28). Printed: ms, floor, and the fused pass's ratio to the torch path and to fp32 AdamW.
On CPU (--device cpu, TRITON_INTERPRET=1, --preset debug) it is a smoke test of this script; its times mean
nothing. The full training step with each path: bash bench/train_weights_check.sh OUT (the `k3 train` rows).
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from torch import nn

from common import kernel_bench_bandwidth, print_table, synchronize, time_ms, write_json

from k3 import K3ForCausalLM, ModelConfig
from k3.ops import master_adamw
from k3.train.master_weights import MasterWeightAdamW
from k3.train.optim import build_optimizer

LRS = (3e-4, 2e-4, 1e-4)  # the check's lr by step (a schedule changes it between steps)
WEIGHT_DECAY = 0.1
MAX_NORM = 1.0  # below the random gradients' global norm: the clip coefficient is applied
BYTES = {"fused": 2 + 28, "torch path": 6 + 12 + 28 + 6, "fp32 AdamW": 12 + 28}  # a parameter, see the docstring


def preset_shapes(preset: str) -> list[tuple[str, torch.Size]]:
    with torch.device("meta"):  # shapes only
        model = K3ForCausalLM(ModelConfig.from_preset(preset))
    return [(name.replace(".", "__"), p.shape) for name, p in model.named_parameters()]


def holder(shapes: list[tuple[str, torch.Size]], device: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """A module of one fp32 parameter per shape (values ~0.02) and a bf16 gradient for each (~1e-3), each pair drawn
    from its own seed so that every variant gets the same numbers."""
    module, grads = nn.Module(), []
    for i, (name, shape) in enumerate(shapes):
        g = torch.Generator(device=device).manual_seed(i)
        module.register_parameter(name, nn.Parameter(torch.randn(shape, device=device, generator=g).mul_(0.02)))
        grads.append(torch.randn(shape, device=device, generator=g).mul_(1e-3).to(torch.bfloat16))
    return module, grads


def master_optimizer(shapes, device: str, fused: bool) -> MasterWeightAdamW:
    module, grads = holder(shapes, device)
    optimizer = MasterWeightAdamW(module, lr=LRS[0], weight_decay=WEIGHT_DECAY, fused=fused)
    for p, g in zip(optimizer.params, grads):
        p.grad = g  # bf16, as the bf16 backward hands them over
    return optimizer


def state_of(optimizer: MasterWeightAdamW) -> dict[str, list[torch.Tensor]]:
    state = [optimizer.inner.state[m] for m in optimizer.masters]
    return {"param": optimizer.params, "master": optimizer.masters, "exp_avg": [s["exp_avg"] for s in state],
            "exp_avg_sq": [s["exp_avg_sq"] for s in state]}


def run_steps(optimizer: MasterWeightAdamW, steps: int) -> list[float]:
    norms = []
    for i in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = LRS[i % len(LRS)]
        norms.append(float(optimizer.clip_grad_norm_(MAX_NORM)))
        optimizer.step()
    return norms


@torch.no_grad()
def check(shapes, device: str, steps: int) -> dict:
    """(a): kernel, twin and torch path from the same values, on one tensor of each distinct shape."""
    distinct = list({tuple(shape): (name, shape) for name, shape in shapes}.values())
    kernel = master_optimizer(distinct, device, fused=True)
    twin = master_optimizer(distinct, device, fused=True)
    reference = master_optimizer(distinct, device, fused=False)
    kernel_norms = run_steps(kernel, steps)
    stepped = kernel.fused_stepped
    available = master_adamw.fused_available
    master_adamw.fused_available = lambda _device: False  # every tensor through the twin
    try:
        twin_norms = run_steps(twin, steps)
    finally:
        master_adamw.fused_available = available
    reference_norms = run_steps(reference, steps)
    synchronize()
    have, want, torch_path = state_of(kernel), state_of(twin), state_of(reference)
    result = {"tensors": len(distinct), "kernel_tensors": stepped, "steps": steps, "equal_to_twin": {},
              "norms_equal": kernel_norms == twin_norms,
              "norm_vs_torch_path_rel": max(abs(a - b) / b for a, b in zip(kernel_norms, reference_norms))}
    for key in have:
        result["equal_to_twin"][key] = all(torch.equal(a, b) for a, b in zip(have[key], want[key]))
        result[f"{key}_vs_torch_path"] = max(float((a.double() - b.double()).abs().max())
                                             / max(float(b.double().abs().max()), 1e-30)
                                             for a, b in zip(have[key], torch_path[key]))
    equal = all(result["equal_to_twin"].values()) and result["norms_equal"] and stepped == len(distinct)
    result["equal"] = equal
    print(f"check ({len(distinct)} distinct shapes, {steps} steps, {stepped} through the kernel): kernel == twin "
          f"{result['equal_to_twin']}, norms equal {result['norms_equal']}; against the torch path (max |diff| / "
          f"max |value|): " + ", ".join(f"{k} {result[f'{k}_vs_torch_path']:.2e}" for k in have)
          + f", norm {result['norm_vs_torch_path_rel']:.2e}", flush=True)
    del kernel, twin, reference
    gc.collect()
    return result


def torch_fused_takes_bf16_grads(device: str) -> str:
    """Whether torch._fused_adamw_ steps an fp32 parameter from a bf16 gradient (its Python wrapper groups tensors
    by the parameters' dtype and checks nothing else; the kernel may)."""
    param = torch.zeros(1024, device=device)
    grad = torch.full((1024,), 1e-3, device=device, dtype=torch.bfloat16)
    moments = [torch.zeros_like(param), torch.zeros_like(param)]
    step = torch.ones((), device=device)
    try:
        torch._fused_adamw_([param], [grad], [moments[0]], [moments[1]], [], [step], lr=1e-3, beta1=0.9,
                            beta2=0.95, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        synchronize()
    except (RuntimeError, NotImplementedError) as error:
        return f"refused: {str(error).splitlines()[0][:200]}"
    return f"accepted (param moved by {float(param.abs().max()):.3g}); it still writes no bf16 copy"


def time_variants(shapes, device: str, bandwidth: float, repeats: int) -> dict:
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    results = {}
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for name in ("torch path", "fused", "fp32 AdamW"):
        module = None
        if name == "fp32 AdamW":
            module, grads = holder(shapes, device)
            for p, g in zip(module.parameters(), grads):
                p.grad = g.float()
            del grads
            optimizer = build_optimizer(module, LRS[0], WEIGHT_DECAY)

            def step():
                torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
                optimizer.step()
        else:
            optimizer = master_optimizer(shapes, device, fused=name == "fused")

            def step():
                optimizer.clip_grad_norm_(MAX_NORM)
                optimizer.step()
        step()  # the moments are made (and kernels compiled) here
        ms = time_ms(step, warmup=3, repeats=repeats)
        floor_ms = numel * BYTES[name] / bandwidth * 1e3
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        results[name] = dict(ms=ms, floor_ms=floor_ms, bytes_per_param=BYTES[name], peak_gib=peak,
                             optimizer=type(getattr(optimizer, "inner", optimizer)).__name__)
        print(f"{name:11s} {ms:8.3f} ms ({ms / floor_ms:.2f}x its floor {floor_ms:.3f} ms), peak {peak:.1f} GiB",
              flush=True)
        optimizer = step = module = None  # freed before the next variant is built
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", "--json", dest="out", default=None)
    args = parser.parse_args()
    bandwidth = kernel_bench_bandwidth("bench/master_adamw.py", args.device, True)
    shapes = preset_shapes(args.preset)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    print(f"{args.preset}: {len(shapes)} tensors, {numel / 1e6:,.1f}M parameters", flush=True)
    payload = dict(bench="master_adamw", preset=args.preset, params=numel, tensors=len(shapes),
                   bandwidth_bytes_per_s=bandwidth, block=master_adamw.BLOCK, num_warps=master_adamw.NUM_WARPS)
    payload["torch_fused_adamw_bf16_grads"] = answer = torch_fused_takes_bf16_grads(args.device)
    print(f"torch._fused_adamw_ with fp32 params and bf16 grads: {answer}", flush=True)
    payload["check"] = check(shapes, args.device, args.check_steps)
    write_json(args.out, payload)
    payload["timing"] = timed = time_variants(shapes, args.device, bandwidth, args.repeats)
    fused = timed["fused"]["ms"]
    payload["fused_over_torch_path"] = fused / timed["torch path"]["ms"]
    payload["fused_over_fp32_adamw"] = fused / timed["fp32 AdamW"]["ms"]
    write_json(args.out, payload)
    print_table(f"clip + AdamW step, {args.preset} ({numel / 1e6:,.0f}M parameters), floor = bytes over "
                f"{bandwidth / 1e12:.2f} TB/s", ["variant", "ms", "floor ms", "/ floor", "fused / this", "peak GiB"],
                [[name, r["ms"], r["floor_ms"], r["ms"] / r["floor_ms"], fused / r["ms"], r["peak_gib"]]
                 for name, r in timed.items()])
    print(f"ratio fused / torch path {payload['fused_over_torch_path']:.3f}, fused / fp32 AdamW "
          f"{payload['fused_over_fp32_adamw']:.3f}; kernel == twin: {payload['check']['equal']}", flush=True)
    if not payload["check"]["equal"]:
        print("FAIL: the kernel is not equal to its twin here; keep K3_MASTER_ADAMW=torch as the CUDA default",
              flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
