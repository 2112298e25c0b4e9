"""The GLU activation on one GPU: k3's Triton kernels (k3.ops.glu_triton), the Inductor-compiled formula (the CUDA
training default before them) and the eager formula, forward and forward + backward, against the bytes' floor.

Usage: python bench/glu.py [--shapes 98304x1024 16384x1024 16384x4096] [--kinds situ silu] [--sweep]
       [--model-loss PRESET] [--device cuda|cpu] [--out FILE]

Shapes are `small`'s at B=4 x 4096 in bf16: the routed experts (16,384 tokens x top-6 pairs, width 1024), the shared
expert (width 1024) and the dense first layer (width 4096). Paths:
  triton    k3.ops.glu_triton.glu_triton, default tiles; --sweep adds a grid of BLOCK_N x BLOCK_F x warps
  compiled  k3.ops.glu.compiled_glu (Inductor, dynamic shapes)
  eager     k3.ops.glu.glu_formula
Times are GPU time per call (the profiler's kernel times summed, bench/attn_res.py's gpu_ms). The floor is the bytes
over the copy bandwidth measured in the same run: forward gate and up read and h written, backward dh, gate and up
read and dgate and dup written. Before timing, every path is checked against the formula in fp32 on the same bf16
inputs (relative error of h, dgate, dup); the script exits 1 when triton's is above 1e-2.
--model-loss PRESET also prints that preset's training loss at initialisation (seed 0, one row of 4,096 random
tokens, training mode so that the training paths run) with K3_GLU_BACKEND=torch / compiled / triton, with fp32 and
with bf16 weights: in fp32 the three agree to rounding; in bf16 their spread is what rounding alone moves the loss.
On CPU (--device cpu with TRITON_INTERPRET=1) it is a smoke test at tiny shapes (--shapes 64x32); its times mean
nothing.
"""

from __future__ import annotations

import argparse
import sys

import torch

from attn_res import gpu_ms
from common import kernel_bench_bandwidth, print_table, relative_error, time_ms, write_json

from k3 import kernels
from k3.ops.glu import compiled_glu, glu_formula
from k3.ops.glu_triton import Blocks, default_blocks, glu_triton

SWEEP = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (8, 1024, 8), (16, 1024, 8), (8, 512, 4), (16, 256, 4),
         (4, 1024, 8), (8, 1024, 16)]


def triton_with(blocks: Blocks | None):
    return lambda gate, up, kind: glu_triton(gate, up, kind, 4.0, 25.0, blocks, blocks)


PATHS = {"triton": triton_with(None), "compiled": lambda g, u, kind: compiled_glu()(g, u, kind, 4.0, 25.0),
         "eager": lambda g, u, kind: glu_formula(g, u, kind, 4.0, 25.0)}


def outputs(fn, gate, up, upstream, kind):
    h = fn(gate, up, kind)
    return [h, *torch.autograd.grad(h, [gate, up], upstream)]


def timings(fn, gate, up, upstream, kind, device) -> dict:
    def forward():
        return fn(gate, up, kind)

    def forward_backward():
        return torch.autograd.grad(forward(), [gate, up], upstream)

    if device == "cuda":
        return dict(fwd=gpu_ms(forward)[0], fwd_bwd=gpu_ms(forward_backward)[0])
    return dict(fwd=time_ms(forward), fwd_bwd=time_ms(forward_backward))


def bench_shape(rows: int, width: int, kind: str, device: str, bandwidth: float, sweep: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(rows + width)
    gate = (torch.randn(rows, width, device=device, generator=gen) * 3).bfloat16().requires_grad_()
    up = (torch.randn(rows, width, device=device, generator=gen) * 10).bfloat16().requires_grad_()
    upstream = torch.randn(rows, width, device=device, generator=gen).bfloat16()
    nbytes = rows * width * gate.element_size()
    floor = dict(fwd=3 * nbytes / bandwidth * 1e3, fwd_bwd=8 * nbytes / bandwidth * 1e3)
    reference = outputs(lambda g, u, k: glu_formula(g.float(), u.float(), k), gate, up, upstream.float(), kind)
    result = dict(rows=rows, width=width, kind=kind, floor_ms=floor, paths={}, rel_errs={})
    for name, fn in PATHS.items():
        got = outputs(fn, gate, up, upstream, kind)
        result["rel_errs"][name] = [relative_error(a.float(), b) for a, b in zip(got, reference)]
        result["paths"][name] = t = timings(fn, gate, up, upstream, kind, device)
        print(f"{rows}x{width} {kind} {name:8s} fwd {t['fwd']:.4f} ms ({t['fwd'] / floor['fwd']:.2f}x floor), "
              f"fwd+bwd {t['fwd_bwd']:.4f} ms ({t['fwd_bwd'] / floor['fwd_bwd']:.2f}x floor); rel err vs fp32 "
              f"(h, dgate, dup) " + ", ".join(f"{e:.1e}" for e in result["rel_errs"][name]), flush=True)
    if sweep:
        swept = {}
        for block_n, block_f, warps in SWEEP:
            label = f"{block_n}/{block_f}/{warps}"
            swept[label] = timings(triton_with(Blocks(block_n, block_f, warps)), gate, up, upstream, kind, device)
        result["sweep"] = swept
        best = min(swept, key=lambda k: swept[k]["fwd_bwd"])
        print(f"  sweep BLOCK_N/BLOCK_F/warps (default {default_blocks(width)}): best fwd+bwd {best}; "
              + ", ".join(f"{k} {v['fwd']:.4f}/{v['fwd_bwd']:.4f}" for k, v in swept.items()), flush=True)
    return result


def model_losses(preset: str, device: str, seq: int) -> dict:
    from k3 import K3ForCausalLM, ModelConfig

    config = ModelConfig.from_preset(preset)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("torch", "compiled", "triton"):
            torch.manual_seed(0)
            with torch.device(device):
                model = K3ForCausalLM(config)
            model = model.to(dtype).train()
            ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
            with kernels.use(glu=backend):
                loss = float(model(ids, labels=ids, return_logits=False).loss.detach())
            losses[f"{str(dtype)[6:]} {backend}"] = loss
            print(f"{preset} {str(dtype)[6:]:8s} K3_GLU_BACKEND={backend:8s} loss {loss:.6f}", flush=True)
            del model
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["98304x1024", "16384x1024", "16384x4096"])
    parser.add_argument("--kinds", nargs="+", default=["situ"], choices=["situ", "silu"])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--model-loss", default=None, metavar="PRESET")
    parser.add_argument("--model-seq", type=int, default=4096)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", "--json", dest="json", default=None)
    args = parser.parse_args()
    bandwidth = kernel_bench_bandwidth("bench/glu.py", args.device, True)
    losses = model_losses(args.model_loss, args.device, args.model_seq) if args.model_loss else None
    results = []
    for shape in args.shapes:
        rows, width = (int(v) for v in shape.split("x"))
        for kind in args.kinds:
            results.append(bench_shape(rows, width, kind, args.device, bandwidth, args.sweep))
            write_json(args.json, dict(bandwidth_bytes_per_s=bandwidth, model_losses=losses, results=results))
    table = []
    for r in results:
        for name, t in r["paths"].items():
            table.append([f"{r['rows']}x{r['width']}", r["kind"], name, t["fwd"], t["fwd"] / r["floor_ms"]["fwd"],
                          t["fwd_bwd"], t["fwd_bwd"] / r["floor_ms"]["fwd_bwd"],
                          r["paths"]["compiled"]["fwd_bwd"] / t["fwd_bwd"], f"{max(r['rel_errs'][name]):.1e}"])
    print_table("GLU activation, bf16, ms per call; floor = bytes over the copy bandwidth measured here",
                ["N x F", "kind", "path", "fwd ms", "/ floor", "fwd+bwd ms", "/ floor", "compiled / this",
                 "max rel err"], table)
    worst = max(max(r["rel_errs"]["triton"]) for r in results)
    if worst > 1e-2:
        print(f"FAIL: the Triton kernels' relative error {worst:.1e} is above 1e-2", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
