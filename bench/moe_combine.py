"""The MoE combine (each token's K expert outputs summed with their gate weights) on one GPU: k3's Triton kernels
against what they replace, forward and forward + backward, in one run.

Usage: python bench/moe_combine.py [--tokens 16384] [--top-k 6] [--width 512] [--experts 64] [--layers 15]
                                   [--device cuda|cpu] [--out FILE]
CPU smoke test (times mean nothing): TRITON_INTERPRET=1 python bench/moe_combine.py --device cpu --tokens 64
                                     --width 40 --layers 2

Shapes default to a `small` training step (B=4 x T=4096 tokens, top-6 of 64 experts, latent width 512, bf16 expert
outputs, fp32 gate weights). Three ops, each with its baseline first:
  combine                 rows in pair order [T, K, L]: the batched matmul (bmm) against the Triton kernels;
  combine (expert order)  rows as the sorted path leaves them, in expert order [N, L] (N = T*K) with the inverse
                          permutation of a real top-k routing: the training path before (unpermute_rows, a row
                          gather into pair order, then the pair-order Triton combine; its backward gathers dy back
                          into expert order) against k3.ops.moe_combine.combine_from_expert_order_triton, which
                          reads the rows through the inverse and writes dy straight into expert order;
  gather_pairs backward   each token's K gradient rows summed out of expert order: index_select into pair order +
                          sum over K (before) against one kernel (sum_pairs_from_expert_order_triton).
`--layers` distinct inputs are timed in turn so that no call finds its bytes in L2 from the one before; times are
per call, and forward_graph is the forward replayed as one CUDA graph (kernel time without the launch overhead).
The floor is the bytes each pass must move over the copy bandwidth measured in the same run: a combine's forward
reads the K rows of every token and writes its output; its backward reads the upstream gradient and the rows and
writes dy; gather_pairs' backward reads the N rows and writes T (index and gate-weight bytes left out, under 1%).
Before timing, every path is compared with an fp64 oracle (output and gradients); the script exits 1 when a
kernel's relative error is above 1e-2 or above twice its baseline's (three times on the CPU: see check).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (device_name, graph_us_per_layer, kernel_bench_bandwidth, print_table, relative_error, time_ms,
                    write_json)

from k3.ops.moe import sort_pairs_by_expert, sum_pairs_per_token_twin, unpermute_rows
from k3.ops.moe_combine import (combine_from_expert_order_triton, combine_pairs_bmm, combine_pairs_triton,
                                sum_pairs_from_expert_order_triton)

PATHS = {"bmm": combine_pairs_bmm, "triton": combine_pairs_triton}


def unpermute_then_combine(y_NL, inverse_N, w_TK, order_N):
    """The training path before the expert-order kernels: the rows gathered into pair order, then combined."""
    y_TKL = unpermute_rows(y_NL, order_N, inverse_N).view(w_TK.shape[0], w_TK.shape[1], y_NL.shape[-1])
    return combine_pairs_triton(y_TKL, w_TK)


EXPERT_ORDER_PATHS = {"unpermute+triton": unpermute_then_combine,
                      "expert-order": lambda y_NL, inverse_N, w_TK, order_N: combine_from_expert_order_triton(
                          y_NL, inverse_N, w_TK)}
SUM_PATHS = {"index_select+sum": lambda g_NL, inverse_N, t, k: sum_pairs_per_token_twin(g_NL, inverse_N, t, k),
             "kernel": lambda g_NL, inverse_N, t, k: sum_pairs_from_expert_order_triton(g_NL, inverse_N, k)}


def errors(fn, y, w, upstream) -> list[float]:
    """Relative errors of the output and the two gradients against fp64."""
    y, w = y.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out = fn(y, w)
    grads = torch.autograd.grad(out, [y, w], upstream)
    y64, w64 = y.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = (y64 * w64.unsqueeze(-1)).sum(1)
    want_grads = torch.autograd.grad(want, [y64, w64], upstream.double())
    return [relative_error(a, b) for a, b in zip([out, *grads], [want, *want_grads])]


def expert_order_errors(fn, y_TKL, w_TK, upstream_TL, order_N, inverse_N) -> list[float]:
    """The same for a combine of expert-order rows, given the pair-order rows y_TKL: fn gets them sorted by expert
    (row i is pair order_N[i]), and dy is compared back in pair order."""
    return errors(lambda y, w: fn(y.reshape(-1, y.shape[-1])[order_N], inverse_N, w, order_N), y_TKL, w_TK,
                  upstream_TL)


def pass_times(forward_of, both_of, layers: int, device: str) -> dict:
    """us per call of forward_of(i) under no_grad (and replayed as one CUDA graph) and, when both_of is given, of
    both_of(i) (forward + backward), over the layers' inputs in turn."""
    times = {}

    def forward():
        with torch.no_grad():
            for i in range(layers):
                forward_of(i)

    times["forward_us"] = time_ms(forward, warmup=2, repeats=10) * 1e3 / layers
    if device == "cuda":
        with torch.no_grad():
            times["forward_graph_us"] = graph_us_per_layer(forward_of, layers)
    if both_of is not None:
        times["forward+backward_us"] = time_ms(lambda: [both_of(i) for i in range(layers)], warmup=2,
                                               repeats=10) * 1e3 / layers
    return times


def check(op: str, results: dict, kernel: str, baseline: str, labels, device: str) -> bool:
    """True when the kernel's errors are within 1e-2 and twice the baseline's (three times on the CPU, where
    Triton's interpreter truncates fp32 to bf16 instead of rounding to nearest: twice the error's norm alone)."""
    factor = 3.0 if device == "cpu" else 2.0
    ok = True
    for label in labels:
        mine, theirs = results[kernel][f"rel_err_{label}"], results[baseline][f"rel_err_{label}"]
        if mine > 1e-2 or mine > factor * max(theirs, 1e-7):
            print(f"FAIL: {op}, {kernel}'s {label} is {mine:.2e} from fp64 ({baseline}: {theirs:.2e})")
            ok = False
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = args.device
    bandwidth = kernel_bench_bandwidth("bench/moe_combine.py", device, wants_triton=True)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    t, k, width = args.tokens, args.top_k, args.width
    inputs = [(torch.randn(t, k, width, device=device, generator=gen).to(dtype).requires_grad_(True),
               torch.rand(t, k, device=device, generator=gen).requires_grad_(True),
               torch.randn(t, width, device=device, generator=gen).to(dtype)) for _ in range(args.layers)]
    # Each layer's own routing: the top-k of random sigmoid scores, sorted by expert as the training path sorts.
    sorts = []
    for _ in range(args.layers):
        ids_N = torch.rand(t, args.experts, device=device, generator=gen).topk(k, dim=-1).indices.reshape(-1)
        order_N, inverse_N, _ = sort_pairs_by_expert(ids_N, args.experts)
        sorts.append((order_N, inverse_N))
    # The expert-order rows of a layer are its pair-order rows sorted: the same numbers as the combine above.
    rows_NL = [y.detach().reshape(-1, width)[order].requires_grad_(True) for (y, _, _), (order, _) in
               zip(inputs, sorts)]
    item = torch.finfo(dtype).bits // 8
    rows_bytes, out_bytes = t * k * width * item, t * width * item
    floor_bytes = {"forward": rows_bytes + out_bytes, "forward+backward": 3 * rows_bytes + 2 * out_bytes,
                   "gather_pairs backward": rows_bytes + out_bytes}

    results, failed = {}, False
    for name, fn in PATHS.items():
        errs = errors(fn, *inputs[0])
        results[name] = {"rel_err_out": errs[0], "rel_err_dy": errs[1], "rel_err_dw": errs[2]}
        results[name].update(pass_times(
            lambda i, fn=fn: fn(*inputs[i][:2]),
            lambda i, fn=fn: torch.autograd.grad(fn(*inputs[i][:2]), inputs[i][:2], inputs[i][2]), args.layers,
            device))
    failed |= not check("combine", results, "triton", "bmm", ("out", "dy", "dw"), device)

    expert_order = {}
    for name, fn in EXPERT_ORDER_PATHS.items():
        errs = expert_order_errors(fn, *inputs[0], *sorts[0])
        expert_order[name] = {"rel_err_out": errs[0], "rel_err_dy": errs[1], "rel_err_dw": errs[2]}

        def call(i, fn=fn):
            return fn(rows_NL[i], sorts[i][1], inputs[i][1], sorts[i][0])

        expert_order[name].update(pass_times(
            call, lambda i, call=call: torch.autograd.grad(call(i), [rows_NL[i], inputs[i][1]], inputs[i][2]),
            args.layers, device))
    failed |= not check("combine (expert order)", expert_order, "expert-order", "unpermute+triton",
                        ("out", "dy", "dw"), device)

    gather_backward = {}
    for name, fn in SUM_PATHS.items():
        order_N, inverse_N = sorts[0]
        grad_NL = rows_NL[0].detach()
        want = grad_NL.double()[inverse_N].view(t, k, width).sum(1)
        gather_backward[name] = {"rel_err_out": relative_error(fn(grad_NL, inverse_N, t, k), want)}
        times = pass_times(lambda i, fn=fn: fn(rows_NL[i].detach(), sorts[i][1], t, k), None, args.layers, device)
        gather_backward[name].update({key.replace("forward", "gather_pairs backward"): us
                                      for key, us in times.items()})
    failed |= not check("gather_pairs backward", gather_backward, "kernel", "index_select+sum", ("out",), device)

    rows = []
    for op, op_results, baseline in (("combine", results, "bmm"),
                                     ("combine (expert order)", expert_order, "unpermute+triton"),
                                     ("gather_pairs backward", gather_backward, "index_select+sum")):
        for name, r in op_results.items():
            errs = " / ".join(f"{r[key]:.1e}" for key in ("rel_err_out", "rel_err_dy", "rel_err_dw") if key in r)
            for phase in [key[:-3] for key in r if key.endswith("_us")]:
                us = r[f"{phase}_us"]
                floor_us = floor_bytes[phase.replace("_graph", "")] / bandwidth * 1e6
                rows.append([op, name, phase, us, floor_us, f"{us / floor_us:.2f}x",
                             f"{op_results[baseline][f'{phase}_us'] / us:.2f}x", errs])
    print_table(f"MoE combine, {t} tokens x top-{k} of {args.experts} x {width}, {args.dtype}, on {device_name()} "
                f"(copy bandwidth {bandwidth / 1e12:.2f} TB/s)",
                ["op", "path", "pass", "us per call", "floor us", "vs floor", "baseline / this",
                 "rel err out / dy / dw"], rows)
    write_json(args.out, {"bench": "moe_combine", "tokens": t, "top_k": k, "width": width, "experts": args.experts,
                          "dtype": args.dtype, "copy_bandwidth": bandwidth, "floor_bytes": floor_bytes,
                          "results": results, "expert_order": expert_order, "gather_pairs_backward": gather_backward})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
