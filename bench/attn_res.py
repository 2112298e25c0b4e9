"""The Attention-Residual mix on one GPU: eager, compiled and Triton (k3.ops.attn_res*), forward and backward.

Usage: python bench/attn_res.py [--tokens 16384] [--dim 1024] [--sources 2 3 4 5] [--full] [--sweep [S ...]]
       [--backends eager compiled triton] [--device cuda|cpu] [--out FILE]

At `small`'s training shapes (N = B*T = 16384 tokens, D = 1024, bf16 sources, S = 2..5 of them; 33 mixes per
forward), and with --full also K3's (D = 7168, S = 10): for each S, S distinct sources [B, T, D] and fp32
norm_weight and query (the parameters' dtype). Paths:
  eager     k3.ops.attn_res.attn_res_mix_eager: stack, fp32 keys and weighted sum in PyTorch
  compiled  the dispatcher forced to "compiled": torch.compile over a torch.stack of the sources, one graph for
            every S and token count (the unbacked token dim)
  triton    k3.ops.attn_res_triton.attn_res_mix_triton with its default blocks; with --sweep also each of a grid
            of BLOCK_N x BLOCK_D x num_warps (the same for both kernels; best forward, backward and both printed)
            and the backward's programs per multiprocessor at its default blocks
Each is timed forward (with autograd recording, as in training) and forward + backward (torch.autograd.grad of
the mix under a random upstream gradient into every source, norm_weight and query), in GPU time per call (the
profiler's kernel, copy and fill times summed: what the mix costs a training step that hides the host's launch
work behind other GPU work) and in CUDA events around the call (host time included). The floor is the bytes read
and written over the copy bandwidth measured in the same run: forward S sources in, the mix out; backward dmix
and S sources in, S gradients out. Before timing, triton is checked against eager (max relative error over the
mix and every gradient); the script exits 1 when that is above 1e-2.
On CPU (--device cpu, with TRITON_INTERPRET=1 for the Triton path) it is a smoke test of this script at tiny
shapes (--tokens 64 --dim 64); its times mean nothing.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common import kernel_bench_bandwidth, print_table, relative_error, time_ms, write_json

from k3.ops.attn_res import attn_res_mix, attn_res_mix_eager, set_attn_res_backend
from k3.ops.attn_res_triton import Blocks, attn_res_mix_triton, default_backward_blocks, default_blocks

EPS = 1e-5
SWEEP_N = (1, 2, 4, 8, 16)
SWEEP_D = (256, 512, 1024)
SWEEP_WARPS = (4, 8)
SWEEP_PROGRAMS_PER_SM = (2, 4, 8, 16, 64)  # the backward's, at its default blocks
FULL = (7168, 10)  # K3's hidden size and about its source count at the last mix


def compiled_mix(sources, norm_weight, query, eps):
    set_attn_res_backend("compiled")
    try:
        return attn_res_mix(sources, norm_weight, query, eps)
    finally:
        set_attn_res_backend(None)


def triton_with(blocks: Blocks | None, backward_blocks: Blocks | None = None):
    """The Triton path with these launch shapes (backward_blocks: blocks' when None; defaults when both None)."""
    return lambda sources, norm_weight, query, eps: attn_res_mix_triton(sources, norm_weight, query, eps, blocks,
                                                                        backward_blocks or blocks)


PATHS = {"eager": attn_res_mix_eager, "compiled": compiled_mix, "triton": triton_with(None)}


def gpu_ms(fn, repeats: int = 10) -> tuple[float, dict[str, float]]:
    """Milliseconds of GPU work per call, kernels, copies and fills summed (the profiler's device times), and the
    same per kernel name. Unlike the events' span this leaves out the host's time between launches, which a
    training step hides behind other GPU work; it is what the mix costs the step. NaN on CPU."""
    if not torch.cuda.is_available():
        return float("nan"), {}
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_name = {e.key: e.self_device_time_total / repeats / 1e3 for e in prof.key_averages()
                if e.self_device_time_total > 0}
    return sum(per_name.values()), per_name


def timings(mix, inputs, upstream) -> dict:
    """Forward and forward + backward: the events' span per call (host time between launches included) and the
    GPU time per call."""
    sources, norm_weight, query = inputs
    leaves = [*sources, norm_weight, query]

    def forward():
        return mix(sources, norm_weight, query, EPS)

    def forward_backward():
        return torch.autograd.grad(forward(), leaves, upstream)

    fwd_gpu, fwd_kernels = gpu_ms(forward)
    both_gpu, both_kernels = gpu_ms(forward_backward)
    return dict(fwd_ms=time_ms(forward, warmup=3, repeats=10), fwd_bwd_ms=time_ms(forward_backward, warmup=3,
                repeats=10), fwd_gpu_ms=fwd_gpu, fwd_bwd_gpu_ms=both_gpu, fwd_bwd_kernels=both_kernels)


def bench_case(tokens: int, dim: int, count: int, device: str, bandwidth: float, backends: list[str],
               sweep: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(count * 131 + dim)
    batch = 4 if tokens % 4 == 0 else 1
    shape = (batch, tokens // batch, dim)
    sources = [(torch.randn(shape, device=device, generator=gen) * (1 + i)).bfloat16().requires_grad_()
               for i in range(count)]
    norm_weight = (torch.rand(dim, device=device, generator=gen) + 0.5).requires_grad_()
    query = (torch.randn(dim, device=device, generator=gen) / dim ** 0.5).requires_grad_()
    upstream = torch.randn(shape, device=device, generator=gen).bfloat16()
    inputs = (sources, norm_weight, query)
    leaves = [*sources, norm_weight, query]

    def outputs(mix):
        out = mix(sources, norm_weight, query, EPS)
        return [out, *torch.autograd.grad(out, leaves, upstream)]

    want = outputs(attn_res_mix_eager)
    errors = [relative_error(a.float(), b.float()) for a, b in zip(outputs(PATHS["triton"]), want)]
    del want
    element = sources[0].element_size()
    forward_bytes = (count + 1) * tokens * dim * element
    backward_bytes = (2 * count + 1) * tokens * dim * element
    floor_fwd = forward_bytes / bandwidth * 1e3
    floor_both = (forward_bytes + backward_bytes) / bandwidth * 1e3
    blocks, backward = default_blocks(count, dim), default_backward_blocks(count, dim)
    result = dict(tokens=tokens, dim=dim, sources=count, triton_rel_err=max(errors), triton_rel_errs=errors,
                  default_blocks=[blocks.block_n, blocks.block_d, blocks.num_warps],
                  default_backward_blocks=[backward.block_n, backward.block_d, backward.num_warps],
                  floor_fwd_ms=floor_fwd, floor_fwd_bwd_ms=floor_both, paths={})
    print(f"S={count} N={tokens} D={dim}: triton vs eager max rel err {max(errors):.2e}, default blocks "
          f"fwd {result['default_blocks']} bwd {result['default_backward_blocks']}, floor fwd {floor_fwd:.3f} ms, "
          f"fwd+bwd {floor_both:.3f} ms", flush=True)
    # On CUDA the GPU time is what counts (and what the sweep ranks by); on CPU, the wall clock.
    key = "gpu_ms" if device == "cuda" else "ms"
    for name in backends:
        t0 = time.perf_counter()
        result["paths"][name] = t = timings(PATHS[name], inputs, upstream)
        print(f"  {name:9s} fwd {t['fwd_' + key]:.3f} ms ({t['fwd_' + key] / floor_fwd:.2f}x floor), fwd+bwd "
              f"{t['fwd_bwd_' + key]:.3f} ms ({t['fwd_bwd_' + key] / floor_both:.2f}x floor); events' span fwd "
              f"{t['fwd_ms']:.3f}, fwd+bwd {t['fwd_bwd_ms']:.3f} ms [{time.perf_counter() - t0:.0f} s]", flush=True)
        if name == "triton" and t["fwd_bwd_kernels"]:
            print("    GPU ms per fwd+bwd: " + ", ".join(f"{k[:40]} {v:.3f}" for k, v in
                                                        sorted(t["fwd_bwd_kernels"].items(), key=lambda kv: -kv[1])))
    if sweep:
        swept = {}
        widths = sorted({min(block_d, max(16, 1 << (dim - 1).bit_length())) for block_d in SWEEP_D})
        for block_n in SWEEP_N:
            for block_d in widths:
                for warps in SWEEP_WARPS:
                    label = f"{block_n}/{block_d}/{warps}"
                    try:
                        t = timings(triton_with(Blocks(block_n, block_d, warps)), inputs, upstream)
                    except Exception as exc:  # a launch shape the compiler rejects is skipped, said
                        print(f"  {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    swept[label] = (t["fwd_" + key], t["fwd_bwd_" + key])
        if device == "cuda":  # the backward's program count, at the default blocks
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            programs = {}
            for per_sm in SWEEP_PROGRAMS_PER_SM:
                with_programs = Blocks(backward.block_n, backward.block_d, backward.num_warps, per_sm * sms)
                t = timings(triton_with(blocks, with_programs), inputs, upstream)
                programs[per_sm] = t["fwd_bwd_gpu_ms"] - t["fwd_gpu_ms"]
            result["backward_ms_by_programs_per_sm"] = programs
            print("  backward GPU ms by programs per SM: " + ", ".join(f"{k} {v:.3f}" for k, v in programs.items()),
                  flush=True)
        if not swept:
            return result
        best_fwd = min(swept, key=lambda k: swept[k][0])
        best_both = min(swept, key=lambda k: swept[k][1])
        bwd_only = {k: both - fwd for k, (fwd, both) in swept.items()}
        best_bwd = min(bwd_only, key=bwd_only.get)
        result["sweep"] = {k: dict(fwd=f, fwd_bwd=b) for k, (f, b) in swept.items()}
        result.update(best_fwd=best_fwd, best_fwd_bwd=best_both, best_bwd=best_bwd)
        print(f"  sweep BLOCK_N/BLOCK_D/warps ({key}): best fwd {best_fwd} {swept[best_fwd][0]:.3f}, best bwd "
              f"{best_bwd} {bwd_only[best_bwd]:.3f}, best fwd+bwd {best_both} {swept[best_both][1]:.3f}", flush=True)
        ranked = sorted(swept.items(), key=lambda kv: kv[1][1])
        print("    fwd/fwd+bwd: " + ", ".join(f"{k} {f:.3f}/{b:.3f}" for k, (f, b) in ranked), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="B*T (B = 4 when it divides)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--sources", nargs="+", type=int, default=[2, 3, 4, 5])
    parser.add_argument("--full", action="store_true", help=f"also D={FULL[0]}, S={FULL[1]} (K3)")
    parser.add_argument("--sweep", nargs="*", type=int, default=None, metavar="S",
                        help="time a grid of Triton launch shapes too, at these source counts (none named: all)")
    parser.add_argument("--backends", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", "--json", dest="json", default=None, help="write the results to this file")
    args = parser.parse_args()
    bandwidth = kernel_bench_bandwidth("bench/attn_res.py", args.device, "triton" in args.backends)
    cases = [(args.dim, count) for count in args.sources] + ([FULL] if args.full else [])
    results = []
    for dim, count in cases:
        sweep = args.sweep is not None and (not args.sweep or count in args.sweep)
        results.append(bench_case(args.tokens, dim, count, args.device, bandwidth, args.backends, sweep))
        write_json(args.json, dict(bandwidth_bytes_per_s=bandwidth, results=results, partial=True))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    key = "gpu_ms" if args.device == "cuda" else "ms"
    rows = []
    for r in results:
        compiled = r["paths"].get("compiled")
        for name, p in r["paths"].items():
            speedup = f"{compiled['fwd_bwd_' + key] / p['fwd_bwd_' + key]:.2f}x" if compiled else "-"
            rows.append([r["sources"], r["dim"], name, f"{p['fwd_' + key]:.3f}",
                         f"{p['fwd_' + key] / r['floor_fwd_ms']:.2f}x", f"{p['fwd_bwd_' + key]:.3f}",
                         f"{p['fwd_bwd_' + key] / r['floor_fwd_bwd_ms']:.2f}x", speedup, f"{p['fwd_ms']:.3f}",
                         f"{p['fwd_bwd_ms']:.3f}", f"{r['triton_rel_err']:.1e}" if name == "triton" else "-"])
    what = "GPU ms per mix (profiler)" if key == "gpu_ms" else "wall ms per mix"
    print_table(f"AttnRes mix, N={args.tokens} tokens, bf16 sources, {what}; floor = bytes over "
                f"{bandwidth / 1e12:.2f} TB/s; span = events around the call, host time included",
                ["S", "D", "path", "fwd", "fwd / floor", "fwd+bwd", "fwd+bwd / floor", "vs compiled", "fwd span",
                 "fwd+bwd span", "rel err"], rows)
    write_json(args.json, dict(bandwidth_bytes_per_s=bandwidth, results=results))
    bad = [(r["sources"], r["dim"]) for r in results if not r["triton_rel_err"] <= 1e-2]
    if bad:
        sys.exit(f"Triton mix too far from eager (S, D): {bad}")


if __name__ == "__main__":
    main()
