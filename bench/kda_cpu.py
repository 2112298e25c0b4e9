"""CPU benchmark of the KDA PyTorch paths: chunk vs fused_recurrent vs the naive loop, measured in the same run.

Usage: python bench/kda_cpu.py [--threads 2] [--lengths 64 256 1024 4096] [--backward]
Prints milliseconds per call (median of repeats) and each path's speed-up over naive_recurrent_kda.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from k3.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_recurrent_kda, set_kda_backend


def make_inputs(B: int, T: int, H: int, K: int, V: int, grad: bool) -> list[torch.Tensor]:
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = kda_gate(torch.randn(B, T, H, K), torch.zeros(H), torch.zeros(H * K), lower_bound=-5.0)
    beta = torch.rand(B, T, H)
    h0 = torch.randn(B, H, K, V)
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta, h0)]


def time_call(fn, inputs: list[torch.Tensor], backward: bool, repeats: int) -> float:
    """Median wall time in ms of fn (plus its backward when asked), after one warm-up call."""
    q, k, v, g, beta, h0 = inputs
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        if backward:
            (o.sum() + ht.sum()).backward()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64, help="K = V (head dim)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    set_kda_backend("torch")
    B, H, D = args.batch, args.heads, args.dim
    mode = "fwd+bwd" if args.backward else "fwd"
    print(f"KDA CPU bench ({mode}), B={B} H={H} K=V={D}, {args.threads} threads, torch {torch.__version__}")
    print(f"{'T':>6} {'naive ms':>10} {'recurrent ms':>13} {'chunk ms':>10} {'recurrent x':>12} {'chunk x':>9}")
    paths = (naive_recurrent_kda, fused_recurrent_kda, chunk_kda)
    for T in args.lengths:
        inputs = make_inputs(B, T, H, D, D, args.backward)
        with torch.set_grad_enabled(args.backward):
            naive, recurrent, chunk = (time_call(fn, inputs, args.backward, args.repeats) for fn in paths)
        print(f"{T:>6} {naive:>10.1f} {recurrent:>13.1f} {chunk:>10.1f} {naive / recurrent:>11.2f}x {naive / chunk:>8.1f}x")


if __name__ == "__main__":
    main()
