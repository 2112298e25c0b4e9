"""The MoE combine (each token's K expert outputs summed with their gate weights) on one GPU: k3's Triton kernels
against the batched matmul they replace, forward and forward + backward, in one run.

Usage: python bench/moe_combine.py [--tokens 16384] [--top-k 6] [--width 512] [--layers 15] [--out FILE]

Shapes default to a `small` training step (B=4 x T=4096 tokens, top-6, latent width 512, bf16 pair outputs, fp32
gate weights). `--layers` distinct inputs are timed in turn so that no call finds its bytes in L2 from the one
before; times are per call, and forward_graph is the forward replayed as one CUDA graph (kernel time without the
launch overhead). The floor is the bytes each pass must move (forward: y read, out written; backward:
y and the upstream gradient read, dy written) over the copy bandwidth measured in the same run. Before timing,
both paths are compared with an fp64 oracle (output and both gradients); the script exits 1 when the kernel's
relative error is above 1e-2 or above twice the batched matmul's.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import copy_bandwidth, device_name, graph_us_per_layer, print_table, relative_error, time_ms, write_json

from k3.ops.moe_combine import combine_pairs_bmm, combine_pairs_triton

PATHS = {"bmm": combine_pairs_bmm, "triton": combine_pairs_triton}


def errors(fn, y, w, upstream) -> list[float]:
    """Relative errors of the output and the two gradients against fp64."""
    y, w = y.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out = fn(y, w)
    grads = torch.autograd.grad(out, [y, w], upstream)
    y64, w64 = y.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = (y64 * w64.unsqueeze(-1)).sum(1)
    want_grads = torch.autograd.grad(want, [y64, w64], upstream.double())
    return [relative_error(a, b) for a, b in zip([out, *grads], [want, *want_grads])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    t, k, width = args.tokens, args.top_k, args.width
    inputs = [(torch.randn(t, k, width, device=device, generator=gen).to(dtype).requires_grad_(True),
               torch.rand(t, k, device=device, generator=gen).requires_grad_(True),
               torch.randn(t, width, device=device, generator=gen).to(dtype)) for _ in range(args.layers)]
    bandwidth = copy_bandwidth() if device == "cuda" else float("nan")
    item = torch.finfo(dtype).bits // 8
    floor_bytes = {"forward": t * k * width * item + t * width * item,
                   "forward+backward": 2 * t * k * width * item + 2 * t * width * item + t * k * width * item}

    results, failed = {}, False
    for name, fn in PATHS.items():
        errs = errors(fn, *inputs[0])
        results[name] = {"rel_err_out": errs[0], "rel_err_dy": errs[1], "rel_err_dw": errs[2]}

        def forward(fn=fn):
            with torch.no_grad():
                for y, w, _ in inputs:
                    fn(y, w)

        def both(fn=fn):
            for y, w, g in inputs:
                torch.autograd.grad(fn(y, w), [y, w], g)

        results[name]["forward_us"] = time_ms(forward, warmup=2, repeats=10) * 1e3 / args.layers
        if device == "cuda":  # the same forwards replayed as one CUDA graph: kernel time without launch overhead
            with torch.no_grad():
                results[name]["forward_graph_us"] = graph_us_per_layer(lambda i, fn=fn: fn(*inputs[i][:2]),
                                                                       args.layers)
        results[name]["forward+backward_us"] = time_ms(both, warmup=2, repeats=10) * 1e3 / args.layers
    for i, label in enumerate(("out", "dy", "dw")):
        mine, twin = results["triton"][f"rel_err_{label}"], results["bmm"][f"rel_err_{label}"]
        if mine > 1e-2 or mine > 2 * max(twin, 1e-7):
            print(f"FAIL: the kernel's {label} is {mine:.2e} from fp64 (bmm: {twin:.2e})")
            failed = True

    rows = []
    for name, r in results.items():
        for phase in [p for p in ("forward", "forward_graph", "forward+backward") if f"{p}_us" in r]:
            us = r[f"{phase}_us"]
            floor_us = floor_bytes[phase.replace("_graph", "")] / bandwidth * 1e6
            rows.append([name, phase, us, floor_us, f"{us / floor_us:.2f}x",
                         f"{results['bmm'].get(f'{phase}_us', float('nan')) / us:.2f}x",
                         f"{r['rel_err_out']:.1e} / {r['rel_err_dy']:.1e} / {r['rel_err_dw']:.1e}"])
    print_table(f"MoE combine, {t} tokens x top-{k} x {width}, {args.dtype}, on {device_name()} "
                f"(copy bandwidth {bandwidth / 1e12:.2f} TB/s)",
                ["path", "pass", "us per call", "floor us", "vs floor", "bmm / this", "rel err out / dy / dw"], rows)
    write_json(args.out, {"bench": "moe_combine", "tokens": t, "top_k": k, "width": width, "dtype": args.dtype,
                          "copy_bandwidth": bandwidth, "floor_bytes": floor_bytes, "results": results})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
