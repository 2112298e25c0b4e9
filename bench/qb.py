"""Quantile Balancing's solver on the device: k3.ops.qb_triton's kernels against their PyTorch twins, in one run.

Usage: python bench/qb.py [--tokens 16384] [--experts 64] [--top-k 6] [--updates 4] [--repeats 50] [--device cuda] [--out qb.json]

Rows (microseconds a call, median of --repeats after warm-up; each op timed over 20 calls in a row so that launch gaps
count as they do inside a captured step):
  topk_with_load        top-(k+1) of scores + bias and the load of the first k picks
  kth_smallest_and_next the per-expert q-th smallest required bias (q = k*T/E) and the next larger value
  solver                solve_batch_bias_on_device with --updates updates (the graphed training step's solver)
Each with K3_QB_BACKEND=torch (torch.topk, scatter_add_, a transposing copy + kthvalue) and =triton, their
outputs compared. The defaults are `small`'s router at B=4 x T=4096.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import device_name, print_table, time_ms, write_json

from k3.layers.balancing import required_bias, solve_batch_bias_on_device
from k3.ops.qb_triton import kth_smallest_and_next, topk_with_load

CALLS = 20


def per_call_us(fn, repeats: int) -> float:
    def many():
        for _ in range(CALLS):
            fn()
    return 1e3 * time_ms(many, warmup=3, repeats=repeats) / CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device=args.device).manual_seed(0)
    scores = torch.sigmoid(torch.randn(args.tokens, args.experts, device=args.device, generator=gen))
    bias = torch.randn(args.experts, device=args.device, generator=gen) * 0.01
    k = args.top_k
    required = required_bias(scores, bias, k, of_others=True)
    q = max(1, round(k * args.tokens / args.experts))
    ops = {
        "topk_with_load": lambda: topk_with_load(scores, bias, k + 1, k),
        "kth_smallest_and_next": lambda: kth_smallest_and_next(required, q),
        "solver": lambda: solve_batch_bias_on_device(scores, bias, k, args.updates, tolerance=0.01),
    }
    results, rows = {}, []
    with torch.no_grad():
        for name, fn in ops.items():
            timed, outputs = {}, {}
            for backend in ("torch", "triton"):
                os.environ["K3_QB_BACKEND"] = backend
                outputs[backend] = fn()
                timed[backend] = per_call_us(fn, args.repeats)
            os.environ.pop("K3_QB_BACKEND", None)
            equal = all(torch.equal(a, b) for a, b in zip(outputs["torch"], outputs["triton"]))
            results[name] = dict(torch_us=timed["torch"], triton_us=timed["triton"], equal=equal)
            rows.append([name, timed["torch"], timed["triton"], f"{timed['torch'] / timed['triton']:.2f}x", equal])
    print_table(f"QB solver, {args.tokens} tokens x {args.experts} experts, top-{k}, on {device_name()}",
                ["op", "torch us", "triton us", "speed-up", "outputs equal"], rows)
    write_json(args.out, {"bench": "qb", "tokens": args.tokens, "experts": args.experts, "top_k": k,
                          "updates": args.updates, "device": device_name(), "results": results})


if __name__ == "__main__":
    main()
