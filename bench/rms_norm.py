"""RMSNorm on one GPU: fla's kernels, k3's Triton kernels (k3.ops.rms_norm_triton) and the PyTorch twin, forward
and forward + backward.

Usage: python bench/rms_norm.py [--rows 16384] [--dims 512 1024 2304 7168] [--paths fla triton torch] [--sweep]
       [--weight-dtype bfloat16] [--device cuda|cpu] [--out FILE]

Why: in `small`'s training step on one H200 (16,384 tokens, hidden 1024, bf16) fla's RMSNorm backward took about
170 us of GPU time a call against ~25 us for its bytes, and ~430 us of host time a call under the profiler.
For each D, x [rows, D] bf16 and a weight [D] (bf16 by default, as bench/train.py trains). Paths:
  fla     k3.ops.norm.rms_norm_fla (fla's rms_norm; today's CUDA path), skipped with a note where fla is absent
  triton  k3.ops.rms_norm_triton.rms_norm_triton with its default blocks; with --sweep also a grid of
          BLOCK_N x BLOCK_D x num_warps (the same for both kernels; best forward, backward and both printed) and
          the backward's programs per multiprocessor at the default blocks
  torch   k3.ops.norm.rms_norm_torch, eager
Each is timed forward (with autograd recording, as in training) and forward + backward (torch.autograd.grad into
x and the weight under a random upstream gradient): GPU time per call (the profiler's kernel, copy and fill times
summed, bench/attn_res.py's gpu_ms: what a step that hides host work behind GPU work pays), the events' span per
call (host time included), and host time per call (the Python side alone: back-to-back calls without a sync,
divided by their count). The floor is the bytes over the copy bandwidth measured in the same run: forward x
read and y written, backward x and dy read and dx written. Before timing, triton (and fla) are checked against
the twin (max relative error over y, dx and dweight); the script exits 1 when triton's is above 1e-2.
On CPU (--device cpu with TRITON_INTERPRET=1) it is a smoke test of this script at tiny shapes
(--rows 16 --dims 64); its times mean nothing.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from attn_res import gpu_ms
from common import kernel_bench_bandwidth, print_table, relative_error, synchronize, time_ms, write_json

from k3.ops.norm import fla_norms_available, rms_norm_fla, rms_norm_torch
from k3.ops.rms_norm_triton import Blocks, default_blocks, programs_per_sm, rms_norm_triton

EPS = 1e-5
SWEEP_N = (1, 2, 4, 8, 16)
SWEEP_D = (1024, 2048, 4096, 8192)  # and the whole row, as the next power of two
SWEEP_WARPS = (4, 8, 16)
SWEEP_MAX_TILE = 16384  # BLOCK_N x BLOCK_D: larger tiles spill registers at any warp count
SWEEP_PROGRAMS_PER_SM = (1, 2, 4, 8, 16)  # the backward's, at its default blocks


def triton_with(blocks: Blocks | None, backward_blocks: Blocks | None = None):
    """The Triton path with these launch shapes (backward_blocks: blocks' when None; defaults when both None)."""
    return lambda x, weight, eps: rms_norm_triton(x, weight, eps, blocks, backward_blocks or blocks)


PATHS = {"fla": rms_norm_fla, "triton": triton_with(None), "torch": rms_norm_torch}


def host_ms(fn, repeats: int = 20) -> float:
    """Host milliseconds per call: back-to-back calls with no sync between them (the GPU queue absorbs the
    kernels while it keeps up), divided by their count."""
    for _ in range(3):
        fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - t0
    synchronize()
    return elapsed * 1e3 / repeats


def timings(norm, x, weight, upstream) -> dict:
    def forward():
        return norm(x, weight, EPS)

    def forward_backward():
        return torch.autograd.grad(forward(), [x, weight], upstream)

    fwd_gpu, _ = gpu_ms(forward)
    both_gpu, both_kernels = gpu_ms(forward_backward)
    return dict(fwd_gpu_ms=fwd_gpu, fwd_bwd_gpu_ms=both_gpu, fwd_bwd_kernels=both_kernels,
                fwd_ms=time_ms(forward, warmup=3, repeats=10),
                fwd_bwd_ms=time_ms(forward_backward, warmup=3, repeats=10),
                fwd_host_ms=host_ms(forward), fwd_bwd_host_ms=host_ms(forward_backward))


def errors_against_twin(norm, x, weight, upstream) -> list[float]:
    """Relative errors of y, dx and dweight against the PyTorch twin."""
    def outputs(fn):
        y = fn(x, weight, EPS)
        return [y, *torch.autograd.grad(y, [x, weight], upstream)]

    return [relative_error(a.float(), b.float()) for a, b in zip(outputs(norm), outputs(rms_norm_torch))]


def sweep_blocks(dim: int, x, weight, upstream, key: str, result: dict) -> None:
    whole = max(16, 1 << (dim - 1).bit_length())
    swept = {}
    for block_n in SWEEP_N:
        for block_d in sorted({min(d, whole) for d in (*SWEEP_D, whole)}):
            for warps in SWEEP_WARPS:
                if block_n * block_d > SWEEP_MAX_TILE:
                    continue
                label = f"{block_n}/{block_d}/{warps}"
                try:
                    t = timings(triton_with(Blocks(block_n, block_d, warps)), x, weight, upstream)
                except Exception as exc:  # a launch shape the compiler rejects is skipped, said
                    print(f"  {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                swept[label] = (t["fwd_" + key], t["fwd_bwd_" + key])
    if torch.cuda.is_available():  # the backward's program count, at the default blocks
        blocks = default_blocks(dim)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        programs = {}
        for per_sm in SWEEP_PROGRAMS_PER_SM:
            with_programs = Blocks(blocks.block_n, blocks.block_d, blocks.num_warps, per_sm * sms)
            t = timings(triton_with(blocks, with_programs), x, weight, upstream)
            programs[per_sm] = t["fwd_bwd_gpu_ms"] - t["fwd_gpu_ms"]
        result["backward_ms_by_programs_per_sm"] = programs
        print(f"  backward GPU ms by programs per SM (default {programs_per_sm(blocks)}): "
              + ", ".join(f"{k} {v:.4f}" for k, v in programs.items()), flush=True)
    if not swept:
        return
    bwd_only = {k: both - fwd for k, (fwd, both) in swept.items()}
    best_fwd = min(swept, key=lambda k: swept[k][0])
    best_both = min(swept, key=lambda k: swept[k][1])
    best_bwd = min(bwd_only, key=bwd_only.get)
    result["sweep"] = {k: dict(fwd=f, fwd_bwd=b) for k, (f, b) in swept.items()}
    result.update(best_fwd=best_fwd, best_fwd_bwd=best_both, best_bwd=best_bwd)
    print(f"  sweep BLOCK_N/BLOCK_D/warps ({key}): best fwd {best_fwd} {swept[best_fwd][0]:.4f}, best bwd "
          f"{best_bwd} {bwd_only[best_bwd]:.4f}, best fwd+bwd {best_both} {swept[best_both][1]:.4f}", flush=True)
    ranked = sorted(swept.items(), key=lambda kv: kv[1][1])
    print("    fwd/fwd+bwd: " + ", ".join(f"{k} {f:.4f}/{b:.4f}" for k, (f, b) in ranked), flush=True)


def bench_dim(rows: int, dim: int, device: str, weight_dtype: torch.dtype, bandwidth: float, paths: list[str],
              sweep: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(dim)
    x = (torch.randn(rows, dim, device=device, generator=gen) * 2).bfloat16().requires_grad_()
    weight = (torch.rand(dim, device=device, generator=gen) + 0.5).to(weight_dtype).requires_grad_()
    upstream = torch.randn(rows, dim, device=device, generator=gen).bfloat16()
    element = x.element_size()
    floor_fwd = 2 * rows * dim * element / bandwidth * 1e3
    floor_both = 5 * rows * dim * element / bandwidth * 1e3
    blocks = default_blocks(dim)
    result = dict(rows=rows, dim=dim, default_blocks=[blocks.block_n, blocks.block_d, blocks.num_warps],
                  floor_fwd_ms=floor_fwd, floor_fwd_bwd_ms=floor_both, rel_errs={}, paths={})
    runnable = [p for p in paths if p != "fla" or (device == "cuda" and fla_norms_available())]
    if "fla" in paths and "fla" not in runnable:
        print(f"  note: fla's rms_norm skipped ({'not importable' if device == 'cuda' else 'CUDA only'})", flush=True)
    for name in [p for p in runnable if p != "torch"]:
        result["rel_errs"][name] = errors_against_twin(PATHS[name], x, weight, upstream)
    print(f"N={rows} D={dim}: default blocks {result['default_blocks']}, floor fwd {floor_fwd:.4f} ms, fwd+bwd "
          f"{floor_both:.4f} ms; max rel err vs the twin (y, dx, dw): "
          + ", ".join(f"{k} {max(v):.1e}" for k, v in result["rel_errs"].items()), flush=True)
    key = "gpu_ms" if device == "cuda" else "ms"
    for name in runnable:
        t0 = time.perf_counter()
        result["paths"][name] = t = timings(PATHS[name], x, weight, upstream)
        print(f"  {name:6s} fwd {t['fwd_' + key]:.4f} ms ({t['fwd_' + key] / floor_fwd:.2f}x floor), fwd+bwd "
              f"{t['fwd_bwd_' + key]:.4f} ms ({t['fwd_bwd_' + key] / floor_both:.2f}x floor); span fwd "
              f"{t['fwd_ms']:.4f}, fwd+bwd {t['fwd_bwd_ms']:.4f} ms; host fwd {t['fwd_host_ms']:.4f}, fwd+bwd "
              f"{t['fwd_bwd_host_ms']:.4f} ms [{time.perf_counter() - t0:.0f} s]", flush=True)
        if t["fwd_bwd_kernels"]:
            print("    GPU ms per fwd+bwd: " + ", ".join(f"{k[:40]} {v:.4f}" for k, v in
                                                        sorted(t["fwd_bwd_kernels"].items(), key=lambda kv: -kv[1])))
    if sweep and "triton" in runnable:
        sweep_blocks(dim, x, weight, upstream, key, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384, help="N = B*T")
    parser.add_argument("--dims", nargs="+", type=int, default=[512, 1024, 2304, 7168])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sweep", action="store_true", help="time a grid of Triton launch shapes too")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", "--json", dest="json", default=None, help="write the results to this file")
    args = parser.parse_args()
    bandwidth = kernel_bench_bandwidth("bench/rms_norm.py", args.device, "triton" in args.paths)
    weight_dtype = getattr(torch, args.weight_dtype)
    results = []
    for dim in args.dims:
        results.append(bench_dim(args.rows, dim, args.device, weight_dtype, bandwidth, args.paths, args.sweep))
        write_json(args.json, dict(bandwidth_bytes_per_s=bandwidth, results=results, partial=True))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    key = "gpu_ms" if args.device == "cuda" else "ms"
    rows = []
    for r in results:
        fla = r["paths"].get("fla")
        for name, p in r["paths"].items():
            speedup = f"{fla['fwd_bwd_' + key] / p['fwd_bwd_' + key]:.2f}x" if fla else "-"
            err = r["rel_errs"].get(name)
            rows.append([r["dim"], name, f"{p['fwd_' + key]:.4f}", f"{p['fwd_' + key] / r['floor_fwd_ms']:.2f}x",
                         f"{p['fwd_bwd_' + key]:.4f}", f"{p['fwd_bwd_' + key] / r['floor_fwd_bwd_ms']:.2f}x", speedup,
                         f"{p['fwd_ms']:.4f}", f"{p['fwd_bwd_ms']:.4f}", f"{p['fwd_host_ms']:.4f}",
                         f"{p['fwd_bwd_host_ms']:.4f}", f"{max(err):.1e}" if err else "-"])
    what = "GPU ms per call (profiler)" if key == "gpu_ms" else "wall ms per call"
    print_table(f"RMSNorm, N={args.rows} rows, bf16 x, {args.weight_dtype} weight, {what}; floor = bytes over "
                f"{bandwidth / 1e12:.2f} TB/s; span = events around the call; host = Python side per call",
                ["D", "path", "fwd", "fwd / floor", "fwd+bwd", "fwd+bwd / floor", "fla / this", "fwd span",
                 "fwd+bwd span", "fwd host", "fwd+bwd host", "rel err vs twin"], rows)
    write_json(args.json, dict(bandwidth_bytes_per_s=bandwidth, results=results))
    bad = [r["dim"] for r in results if "triton" in r["rel_errs"] and not max(r["rel_errs"]["triton"]) <= 1e-2]
    if bad:
        sys.exit(f"Triton RMSNorm too far from the twin at D = {bad}")


if __name__ == "__main__":
    main()
