"""MLA's absorbed decode attention on one GPU: k3's flash-decode Triton kernel against the einsum path, in one run.

Usage: python bench/mla_decode.py [--batch 1 64] [--context 8192 131072] [--layers 4] [--no-sweep] [--out FILE]

At `small`'s MLA shapes (8 heads, kv_lora_rank 256, rope 64, bf16, one query token per row) and each batch x
context: `--layers` distinct latent caches exist (small has 4 MLA layers), so that no layer finds its cache in
L2 from the layer before. The mask is a StaticCache's [T, S] one with every slot filled (the CUDA-graph decode
step's form). Each path runs all layers inside one captured CUDA graph, as decode does; the result is
microseconds per layer (per call) and over all layers. Paths (both from q_latent = q_nope W_uk to out_latent,
before W_uv, which they share):
  einsum    k3.ops.mla_decode.latent_attention_einsum: scores, mask, softmax, probabilities @ latent
  triton    k3.ops.mla_decode.latent_attention_triton_eager with its default blocks and split count; also a
            small sweep of BLOCK_S x num_warps, best printed (--no-sweep leaves it out)
The floor is the latent + k_rope bytes over the copy bandwidth measured in the same run (a device-to-device
copy). Before timing, each path is compared with the fp32 einsum (relative error); the script exits 1 when the
kernel is further from it than both 1e-2 and twice the bf16 einsum's error. A case that fails (out of memory)
is reported and skipped.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import copy_bandwidth, device_name, graph_us_per_layer, print_table, relative_error, write_json

from k3.ops.mla_decode import latent_attention_einsum, latent_attention_triton_eager, num_splits

HEADS, RANK, ROPE, NOPE = 8, 256, 64, 64  # `small`
SCALE = (NOPE + ROPE) ** -0.5
SWEEP_S = (32, 64, 128)
SWEEP_WARPS = (4, 8)


def bench_case(batch: int, context: int, layers: int, bandwidth: float, sweep: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    caches = [(torch.randn(batch, context, RANK, device="cuda", generator=gen).bfloat16(),
               torch.randn(batch, context, ROPE, device="cuda", generator=gen).bfloat16()) for _ in range(layers)]
    queries = [(torch.randn(batch, HEADS, 1, RANK, device="cuda", generator=gen).div_(4).bfloat16(),
                torch.randn(batch, 1, HEADS, ROPE, device="cuda", generator=gen).bfloat16()) for _ in range(layers)]
    position = torch.tensor(context - 1, device="cuda")  # StaticMLASlot.append's mask, every slot filled
    mask = torch.arange(context, device="cuda")[None, :] <= position + torch.arange(1, device="cuda")[:, None]

    def einsum(i):
        return latent_attention_einsum(*queries[i], *caches[i], mask, 0, SCALE)

    def triton_with(block_s=None, num_warps=None):
        def run(i):
            return latent_attention_triton_eager(*queries[i], *caches[i], mask, 0, SCALE, block_s=block_s,
                                                 num_warps=num_warps)
        return run

    want = latent_attention_einsum(*(t.float() for t in queries[0] + caches[0]), mask, 0, SCALE)
    errors = dict(einsum_rel_err=relative_error(einsum(0).float(), want),
                  triton_rel_err=relative_error(triton_with()(0).float(), want))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_splits(batch, context, 64, num_sms)[0]
    result = dict(batch=batch, context=context, layers=layers, splits=splits, **errors)
    print(f"B={batch} S={context}: rel err einsum {errors['einsum_rel_err']:.2e} triton "
          f"{errors['triton_rel_err']:.2e}, {splits} splits", flush=True)
    result["einsum_us"] = graph_us_per_layer(einsum, layers)
    print(f"  einsum {result['einsum_us']:.1f} us", flush=True)
    result["triton_us"] = graph_us_per_layer(triton_with(), layers)
    print(f"  triton {result['triton_us']:.1f} us", flush=True)
    swept = {}
    for block_s in SWEEP_S if sweep else ():
        for warps in SWEEP_WARPS:
            try:
                swept[f"{block_s}/{warps}"] = graph_us_per_layer(triton_with(block_s, warps), layers)
            except Exception as exc:  # a block size the compiler rejects (shared memory) is skipped, said
                print(f"  BLOCK_S {block_s}, {warps} warps: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    best = min(swept, key=swept.get) if swept else "-"
    floor_us = batch * context * (RANK + ROPE) * 2 / bandwidth * 1e6
    result.update(sweep_us=swept, best=best, best_us=swept.get(best, result["triton_us"]), floor_us=floor_us,
                  einsum_vs_floor=result["einsum_us"] / floor_us, triton_vs_floor=result["triton_us"] / floor_us,
                  speedup=result["einsum_us"] / result["triton_us"])
    print(f"B={batch} S={context}: einsum {result['einsum_us']:.1f} us, triton {result['triton_us']:.1f} us "
          f"(best BLOCK_S/warps {best}: {result['best_us']:.1f}), floor {floor_us:.1f} us, speed-up "
          f"{result['speedup']:.2f}x, triton / floor {result['triton_vs_floor']:.2f}x", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--context", nargs="+", type=int, default=[8192, 131072])
    parser.add_argument("--layers", type=int, default=4, help="distinct caches (small has 4 MLA layers)")
    parser.add_argument("--no-sweep", action="store_true", help="time only the default blocks")
    parser.add_argument("--out", "--json", dest="json", default=None, help="write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/mla_decode.py needs a CUDA device")
    bandwidth = copy_bandwidth()
    print(f"{device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results, failed = [], []
    for batch in args.batch:
        for context in args.context:
            try:
                results.append(bench_case(batch, context, args.layers, bandwidth, not args.no_sweep))
            except Exception as exc:  # out of memory at a big case must not lose the others
                failed.append(dict(batch=batch, context=context, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                print(f"B={batch} S={context} failed: {failed[-1]['error']}", flush=True)
            torch.cuda.empty_cache()
    if results:
        print_table(f"absorbed MLA decode attention per layer (small: {HEADS} heads, R {RANK}, rope {ROPE}, bf16, "
                    f"one query), one CUDA graph over {args.layers} layers",
                    ["batch", "context", "splits", "einsum us", "triton us", "speed-up", "best sweep", "floor us",
                     "einsum / floor", "triton / floor", f"triton x{args.layers} us", "rel err"],
                    [[r["batch"], r["context"], r["splits"], f"{r['einsum_us']:.1f}", f"{r['triton_us']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['best']} {r['best_us']:.1f}", f"{r['floor_us']:.1f}",
                      f"{r['einsum_vs_floor']:.2f}x", f"{r['triton_vs_floor']:.2f}x",
                      f"{r['triton_us'] * args.layers:.1f}", f"{r['triton_rel_err']:.1e}"] for r in results])
    if args.json:
        write_json(args.json, dict(device=device_name(), bandwidth_bytes_per_s=bandwidth, results=results,
                                   failed=failed))
    bad = [r for r in results if r["triton_rel_err"] > max(1e-2, 2 * r["einsum_rel_err"])]
    if bad:
        sys.exit(f"Triton kernel too far from the fp32 einsum: {[(r['batch'], r['context']) for r in bad]}")


if __name__ == "__main__":
    main()
