"""KDA's short conv (depthwise causal, W taps, + SiLU) on one GPU at `small`'s training shape: fla's causal_conv1d
(the CUDA path before k3's kernels), the PyTorch twin, k3's Triton kernels joined (k3.ops.short_conv_triton) and
planar (short_conv_triton_parts: q, k, v contiguous), forward and backward, against the bytes' floor.

Usage: python bench/conv.py [--batch 4] [--length 4096] [--channels 3072] [--width 4] [--parts 3]
       [--dtype bf16|fp16|fp32] [--sweep] [--json FILE]

x [B, T, C] holds q, k and v side by side (C = 3 x 1024 at `small`). Times are medians of CUDA-event spans over
CALLS back-to-back calls (launch gaps hidden, as in a training step), per call. backward is the backward alone,
through a graph kept from one forward (fla's includes the forward it recomputes). `split copies` is what the
planar parts remove from a step: the joined output's column slices made contiguous (fla's chunk_kda copies each)
forward, and the cat of dq, dk, dv into one gradient backward. The floor is the bytes over the copy bandwidth
measured in the same run: forward x read and y written, backward x and dy read and dx written.
Before timing, the Triton paths are checked against the twin in fp32 (max abs error of y, dx, dweight; exit 1
above 1e-3). --sweep times a grid of ConvBlocks forward and backward and prints the best of each.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common import kernel_bench_bandwidth, print_table, time_ms, write_json

from k3.ops.short_conv import fla_conv_available, short_conv_fla, short_conv_torch
from k3.ops.short_conv_triton import (BACKWARD_BLOCKS, FORWARD_BLOCKS, ConvBlocks, short_conv_triton,
                                      short_conv_triton_parts)

CALLS = 10
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# 3 x 3 x 2 launch shapes, (rows, warps) in two pairs: a grid that compiles (forward and backward) in about a
# minute on one H200; the defaults are timed beside it.
SWEEP = [ConvBlocks(block_t, block_c, rows, warps) for block_t in (32, 64, 128) for block_c in (128, 256, 512)
         for rows, warps in ((8, 2), (4, 4))]


def warm_up_gpu(seconds: float = 1.5) -> None:
    """Matrix products until the clocks have risen: the first path timed would otherwise pay for the ramp."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def per_call_ms(fn) -> float:
    def calls():
        for _ in range(CALLS):
            fn()

    return time_ms(calls, warmup=3, repeats=15) / CALLS


def forward_backward_ms(forward, leaves, upstream) -> dict:
    """forward alone; backward alone, through one forward's graph kept across calls."""
    with torch.no_grad():
        fwd = per_call_ms(forward)
    outputs = forward()
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    grads = upstream if isinstance(upstream, (list, tuple)) else [upstream]
    bwd = per_call_ms(lambda: torch.autograd.grad(outputs, leaves, grads, retain_graph=True))
    return dict(fwd=fwd, bwd=bwd)


def max_errors(got, want) -> list[float]:
    return [float((a.detach().float() - b.detach().float()).abs().max()) for a, b in zip(got, want)]


def check_fp32(x, weight, parts) -> dict:
    """Max abs error of the Triton paths' y, dx and dweight against the twin, all in fp32 on the same inputs."""
    x32 = x.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    upstream = torch.randn_like(x32)
    y = short_conv_torch(x32, w32)[0]
    want = [y, *torch.autograd.grad(y, [x32, w32], upstream)]
    y = short_conv_triton(x32, w32)
    joined = max_errors([y, *torch.autograd.grad(y, [x32, w32], upstream)], want)
    ys = short_conv_triton_parts(x32, w32, parts)
    planar = max_errors([torch.cat(ys, -1), *torch.autograd.grad(ys, [x32, w32], upstream.chunk(parts, -1))],
                        want)
    return {"triton joined": joined, "triton planar": planar}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=3072)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--parts", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", "--out", dest="json", default=None)
    args = parser.parse_args()
    bandwidth = kernel_bench_bandwidth("bench/conv.py", "cuda", True, cpu_smoke=False)
    batch, length, channels, dtype = args.batch, args.length, args.channels, DTYPES[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, length, channels, device="cuda", generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(channels, args.width, device="cuda", generator=gen) * 0.5).to(dtype).requires_grad_()
    upstream = torch.randn(batch, length, channels, device="cuda", generator=gen).to(dtype)
    upstream_parts = [p.contiguous() for p in upstream.chunk(args.parts, -1)]

    errors = check_fp32(x, weight, args.parts)
    warm_up_gpu()
    for name, errs in errors.items():
        print(f"fp32 check, {name} vs twin: max abs error y {errs[0]:.2e}, dx {errs[1]:.2e}, dweight "
              f"{errs[2]:.2e}", flush=True)

    plane = batch * length * channels * x.element_size()
    floor = dict(fwd=2 * plane / bandwidth * 1e3, bwd=3 * plane / bandwidth * 1e3)
    leaves = [x, weight]
    paths = {"torch twin": (lambda: short_conv_torch(x, weight)[0], upstream),
             "triton joined": (lambda: short_conv_triton(x, weight), upstream),
             "triton planar": (lambda: short_conv_triton_parts(x, weight, args.parts), upstream_parts)}
    if fla_conv_available():
        paths = {"fla causal_conv1d": (lambda: short_conv_fla(x, weight)[0], upstream), **paths}
    else:
        print("fla's causal_conv1d is not importable here: its row is skipped", flush=True)
    results = {}
    for name, (forward, grads) in paths.items():
        results[name] = t = forward_backward_ms(forward, leaves, grads)
        print(f"{name:18s} fwd {t['fwd'] * 1e3:7.1f} us, bwd {t['bwd'] * 1e3:7.1f} us", flush=True)
    y = short_conv_triton(x.detach(), weight.detach())
    results["split copies"] = dict(fwd=per_call_ms(lambda: [p.contiguous() for p in y.chunk(args.parts, -1)]),
                                   bwd=per_call_ms(lambda: torch.cat(upstream_parts, -1)))

    sweep = None
    if args.sweep:
        sweep = {}
        for blocks in [FORWARD_BLOCKS, BACKWARD_BLOCKS, *SWEEP]:
            label = f"{blocks.block_t}/{blocks.block_c}/{blocks.rows}/{blocks.num_warps}"
            if label in sweep:
                continue
            sweep[label] = forward_backward_ms(
                lambda b=blocks: short_conv_triton_parts(x, weight, args.parts, blocks=b, backward_blocks=b),
                leaves, upstream_parts)
        for pass_ in ("fwd", "bwd"):
            best = min(sweep, key=lambda k: sweep[k][pass_])
            print(f"sweep block_t/block_c/rows/warps, {pass_}: best {best} {sweep[best][pass_] * 1e3:.1f} us; "
                  + ", ".join(f"{k} {v[pass_] * 1e3:.1f}" for k, v in sorted(sweep.items(),
                                                                            key=lambda kv: kv[1][pass_])[:6]),
                  flush=True)

    base = results.get("fla causal_conv1d")
    table = [[name, t["fwd"] * 1e3, t["fwd"] / floor["fwd"], t["bwd"] * 1e3, t["bwd"] / floor["bwd"],
              (t["fwd"] + t["bwd"]) * 1e3, (base["fwd"] + base["bwd"]) / (t["fwd"] + t["bwd"]) if base else "-"]
             for name, t in results.items()]
    table.append(["floor (bytes / copy bw)", floor["fwd"] * 1e3, 1.0, floor["bwd"] * 1e3, 1.0,
                  (floor["fwd"] + floor["bwd"]) * 1e3, "-"])
    print_table(f"short conv, x [{batch}, {length}, {channels}] {args.dtype}, W = {args.width}, us per call",
                ["path", "fwd us", "/ floor", "bwd us", "/ floor", "fwd+bwd us", "fla / this"], table)
    write_json(args.json, dict(shape=[batch, length, channels], width=args.width, parts=args.parts,
                               dtype=args.dtype, bandwidth_bytes_per_s=bandwidth, floor_ms=floor,
                               fp32_max_abs_errors=errors, results=results, sweep=sweep))
    worst = max(max(errs) for errs in errors.values())
    if worst > 1e-3:
        print(f"FAIL: the Triton paths' fp32 max abs error {worst:.2e} is above 1e-3", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
