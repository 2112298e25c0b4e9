"""One AdamW step over a preset's parameters on one GPU: torch's fused and foreach AdamW against k3's SplitAdamW
(k3.train.optim: k3.ops.adamw_triton's kernel for the large tensors, torch's fused kernel for the rest), against
the bytes' floor.

Usage: python bench/adamw.py [--preset small] [--repeats 20] [--check-steps 3] [--blocks] [--min-numel]
       [--device cuda|cpu] [--json PATH]

The parameters are the preset's own shapes (the model built on the meta device, then one bf16 tensor a parameter
on the GPU, random values and random bf16 gradients, allocated once), grouped as build_optimizer groups them
(weight decay 0.1 on matrices, none on the rest; betas 0.9 / 0.95). Every optimizer steps the same tensors and
gradients, each with moments of its own (bf16, as torch makes them for bf16 parameters).

(a) Check: --check-steps steps (lr changing between them) of SplitAdamW and of torch's fused AdamW on bf16 copies,
and of torch's fused AdamW on fp32 copies with the same gradients in fp32 (the reference): the largest absolute
difference of params, exp_avg and exp_avg_sq against torch's fused and against fp32, the largest in bf16 ulps
against torch's fused, and the relative error (norm) of each against fp32. Exits 1 where SplitAdamW's error
against fp32 is above 1.1x torch's fused one: it has to be as accurate as what it replaces.
(b) Timing: one optimizer.step() (CUDA events around the whole call, host launches included; 3 untimed steps,
then the median of --repeats) of torch's fused AdamW, torch's foreach AdamW and SplitAdamW (min_numel
TRITON_MIN_NUMEL). The floor: the bytes a step reads and writes (param, grad, exp_avg, exp_avg_sq read; param
and both moments written: 14 bytes a parameter in bf16) over the device-to-device copy bandwidth measured in
the same run; each variant's ratio to it.
--blocks: the kernel alone on the largest tensor at BLOCK {1024, 2048, 4096, 8192} x num_warps {4, 8}, each
against that tensor's floor; the best is printed. --min-numel: SplitAdamW's step at several thresholds.
On CPU (--device cpu, TRITON_INTERPRET=1, e.g. --preset debug) it is a smoke test of this script; its times mean
nothing.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from torch import nn

from common import kernel_bench_bandwidth, print_table, synchronize, time_ms, write_json

from k3 import K3ForCausalLM, ModelConfig, kernels
from k3.ops import adamw_triton
from k3.train import optim
from k3.train.optim import SplitAdamW, build_optimizer

LRS = (3e-4, 2e-4, 1e-4)  # lr of the check's steps, in turn (a schedule changes it between steps)
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)  # build_optimizer's
BLOCKS = [(block, warps) for block in (1024, 2048, 4096, 8192) for warps in (4, 8)]
MIN_NUMELS = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)


def preset_parameters(preset: str, device: str) -> nn.Module:
    """A module holding one bf16 tensor (values ~0.02, gradient ~1e-3, both random) for each parameter of the
    preset, under its name with dots as "__" (build_optimizer's grouping reads "embed_tokens" in the name)."""
    with torch.device("meta"):  # shapes only: nothing is allocated or initialised
        model = K3ForCausalLM(ModelConfig.from_preset(preset))
    holder = nn.Module()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, meta in model.named_parameters():
        p = nn.Parameter(torch.randn(meta.shape, device=device, generator=gen, dtype=torch.bfloat16).mul_(0.02))
        p.grad = torch.randn(meta.shape, device=device, generator=gen, dtype=torch.bfloat16).mul_(1e-3)
        holder.register_parameter(name.replace(".", "__"), p)
    return holder


def param_groups(holder: nn.Module) -> list[dict]:
    """build_optimizer's groups (decay on matrices but the embedding), through build_optimizer itself."""
    with kernels.use(adamw="torch"):
        built = build_optimizer(holder, LRS[0], WEIGHT_DECAY, betas=BETAS)
    return [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in built.param_groups]


def copies(groups: list[dict], dtype: torch.dtype) -> list[dict]:
    """The groups over new leaf tensors holding the same values and gradients in `dtype`."""
    out = []
    for g in groups:
        params = []
        for p in g["params"]:
            q = nn.Parameter(p.detach().to(dtype, copy=True))
            q.grad = p.grad.to(dtype, copy=True)
            params.append(q)
        out.append({**g, "params": params})
    return out


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in bf16 spacings at max(|a|, |b|) (its smallest normal spacing at 0)."""
    a64, b64 = a.double(), b.double()
    finfo = torch.finfo(torch.bfloat16)
    _, exponent = torch.frexp(torch.maximum(a64.abs(), b64.abs()).clamp_min(finfo.tiny))
    ulp = finfo.eps * torch.pow(2.0, exponent.double() - 1)
    return float(((a64 - b64).abs() / ulp).max())


def tensors_of(opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"param": params, "exp_avg": [opt.state[p]["exp_avg"] for p in params],
            "exp_avg_sq": [opt.state[p]["exp_avg_sq"] for p in params]}


@torch.no_grad()
def check(groups: list[dict], steps: int) -> dict:
    """(a): SplitAdamW and torch's fused AdamW on bf16 copies, torch's fused AdamW on fp32 copies."""
    kinds = {"split": (SplitAdamW, torch.bfloat16), "fused": (torch.optim.AdamW, torch.bfloat16),
             "fp32": (torch.optim.AdamW, torch.float32)}
    opts = {name: cls(copies(groups, dtype), lr=LRS[0], betas=BETAS, eps=1e-8, fused=True)
            for name, (cls, dtype) in kinds.items()}
    for i in range(steps):
        for opt in opts.values():
            for g in opt.param_groups:
                g["lr"] = LRS[i % len(LRS)]
            opt.step()
    synchronize()
    have = {name: tensors_of(opt) for name, opt in opts.items()}
    result = {"steps": steps, "triton_stepped": opts["split"].triton_stepped, "tensors": {}}
    for key in ("param", "exp_avg", "exp_avg_sq"):
        row = {"split_vs_fused_max_abs": 0.0, "split_vs_fused_max_bf16_ulps": 0.0, "split_vs_fp32_max_abs": 0.0,
               "fused_vs_fp32_max_abs": 0.0}
        squares = {"split": 0.0, "fused": 0.0, "ref": 0.0}
        for s, f, r in zip(have["split"][key], have["fused"][key], have["fp32"][key]):
            s64, f64, r64 = s.double(), f.double(), r.double()
            row["split_vs_fused_max_abs"] = max(row["split_vs_fused_max_abs"], float((s64 - f64).abs().max()))
            row["split_vs_fused_max_bf16_ulps"] = max(row["split_vs_fused_max_bf16_ulps"], bf16_ulps(s, f))
            row["split_vs_fp32_max_abs"] = max(row["split_vs_fp32_max_abs"], float((s64 - r64).abs().max()))
            row["fused_vs_fp32_max_abs"] = max(row["fused_vs_fp32_max_abs"], float((f64 - r64).abs().max()))
            squares["split"] += float((s64 - r64).square().sum())
            squares["fused"] += float((f64 - r64).square().sum())
            squares["ref"] += float(r64.square().sum())
        row["split_vs_fp32_rel"] = (squares["split"] / max(squares["ref"], 1e-300)) ** 0.5
        row["fused_vs_fp32_rel"] = (squares["fused"] / max(squares["ref"], 1e-300)) ** 0.5
        result["tensors"][key] = row
        print(f"check {key:10s} " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    del opts, have
    gc.collect()
    return result


def step_bytes(opt: torch.optim.Optimizer) -> int:
    """What one step reads and writes at the least: param, grad and both moments read, param and moments written,
    each in its own dtype (after a step has made the moments)."""
    total = 0
    for g in opt.param_groups:
        for p in g["params"]:
            state = opt.state[p]
            total += p.numel() * (2 * p.element_size() + p.grad.element_size()
                                  + 2 * state["exp_avg"].element_size() + 2 * state["exp_avg_sq"].element_size())
    return total


def time_variants(groups: list[dict], bandwidth: float, repeats: int, sweep_min_numel: bool) -> dict:
    """(b): each optimizer built over the shared tensors, timed, then freed (its moments with it)."""
    variants = {"torch fused": lambda: torch.optim.AdamW(groups, lr=LRS[0], betas=BETAS, fused=True),
                "torch foreach": lambda: torch.optim.AdamW(groups, lr=LRS[0], betas=BETAS, foreach=True),
                "SplitAdamW": lambda: SplitAdamW(groups, lr=LRS[0], betas=BETAS, fused=True)}
    results = {}
    for name, build in variants.items():
        opt = build()
        opt.step()  # makes the moments (and compiles the kernel)
        floor_ms = step_bytes(opt) / bandwidth * 1e3
        ms = time_ms(opt.step, warmup=3, repeats=repeats)
        results[name] = dict(ms=ms, floor_ms=floor_ms, bytes=step_bytes(opt),
                             triton_stepped=getattr(opt, "triton_stepped", 0))
        print(f"{name:14s} {ms:.3f} ms a step ({ms / floor_ms:.2f}x the floor {floor_ms:.3f} ms)", flush=True)
        if name == "SplitAdamW" and sweep_min_numel:
            results["min_numel"] = {}
            for threshold in MIN_NUMELS:
                opt.min_numel = threshold
                opt.step()
                t = time_ms(opt.step, warmup=2, repeats=repeats)
                results["min_numel"][threshold] = dict(ms=t, triton_stepped=opt.triton_stepped)
                print(f"  min_numel {threshold:>9,d}: {t:.3f} ms ({t / floor_ms:.2f}x the floor), "
                      f"{opt.triton_stepped} tensors through the kernel", flush=True)
        del opt
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def sweep_blocks(groups: list[dict], bandwidth: float, repeats: int) -> dict:
    """The kernel alone on the largest tensor (its own moments, step count 1) at each BLOCK x num_warps."""
    param = max((p for g in groups for p in g["params"]), key=lambda p: p.numel())
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step = torch.ones((), device=param.device)
    floor_ms = param.numel() * 14 / bandwidth * 1e3  # bf16 param, grad and moments: 7 tensors' passes of 2 bytes
    swept = {}
    for block, warps in BLOCKS:
        def run():
            adamw_triton.adamw_step_triton(param.data, param.grad, exp_avg, exp_avg_sq, step, LRS[0], *BETAS, 1e-8,
                                           WEIGHT_DECAY, block=block, num_warps=warps)
        swept[f"{block}/{warps}"] = ms = time_ms(run, warmup=2, repeats=repeats)
        print(f"  BLOCK {block:5d} num_warps {warps}: {ms:.4f} ms ({ms / floor_ms:.2f}x the floor)", flush=True)
    best = min(swept, key=swept.get)
    default = f"{adamw_triton.BLOCK}/{adamw_triton.NUM_WARPS}"
    print(f"blocks on {tuple(param.shape)} ({param.numel():,d} elements; floor {floor_ms:.4f} ms): best {best} "
          f"{swept[best]:.4f} ms, default {default} {swept.get(default, float('nan')):.4f} ms", flush=True)
    return dict(shape=list(param.shape), floor_ms=floor_ms, ms=swept, best=best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--blocks", action="store_true", help="sweep BLOCK x num_warps on the largest tensor")
    parser.add_argument("--min-numel", action="store_true", help="sweep SplitAdamW's TRITON_MIN_NUMEL")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", "--out", dest="json", default=None)
    args = parser.parse_args()
    bandwidth = kernel_bench_bandwidth("bench/adamw.py", args.device, True)
    holder = preset_parameters(args.preset, args.device)
    groups = param_groups(holder)
    numel = sum(p.numel() for p in holder.parameters())
    picked = optim.adamw_class(optim.fused_pays(list(holder.parameters()))).__name__
    print(f"{args.preset}: {len(list(holder.parameters()))} tensors, {numel / 1e6:,.1f}M parameters in bf16; "
          f"build_optimizer picks {picked} here (K3_ADAMW={kernels.choice('adamw')})", flush=True)
    payload = dict(bench="adamw", preset=args.preset, params=numel, bandwidth_bytes_per_s=bandwidth,
                   build_optimizer_picks=picked, min_numel=optim.TRITON_MIN_NUMEL,
                   block=adamw_triton.BLOCK, num_warps=adamw_triton.NUM_WARPS)
    payload["check"] = check(groups, args.check_steps)
    write_json(args.json, payload)
    payload["timing"] = timed = time_variants(groups, bandwidth, args.repeats, args.min_numel)
    write_json(args.json, payload)
    if args.blocks:
        payload["blocks"] = sweep_blocks(groups, bandwidth, args.repeats)
        write_json(args.json, payload)
    base = timed["torch fused"]["ms"]
    print_table(f"One AdamW step, {args.preset} ({numel / 1e6:,.0f}M bf16 params, bf16 moments), floor = bytes over "
                f"{bandwidth / 1e12:.2f} TB/s", ["optimizer", "ms", "floor ms", "/ floor", "fused / this",
                                                  "kernel tensors"],
                [[name, r["ms"], r["floor_ms"], r["ms"] / r["floor_ms"], base / r["ms"], r["triton_stepped"]]
                 for name, r in timed.items() if name != "min_numel"])
    worse = {key: row for key, row in payload["check"]["tensors"].items()
             if row["split_vs_fp32_rel"] > 1.1 * row["fused_vs_fp32_rel"] + 1e-12}
    if worse:
        print(f"FAIL: SplitAdamW is further from fp32 than torch's fused AdamW in {sorted(worse)}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
