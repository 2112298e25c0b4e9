"""MLA's absorbed decode attention on one GPU: k3's flash-decode Triton kernel against the einsum path, in one run.

Usage: python bench/mla_decode.py [--batch 1 64] [--context 8192 131072] [--layers 4] [--no-sweep | --wide-sweep]
       [--no-paged] [--out FILE]

At `small`'s MLA shapes (8 heads, kv_lora_rank 256, rope 64, bf16, one query token per row) and each batch x
context: `--layers` distinct latent caches exist (small has 4 MLA layers), so that no layer finds its cache in
L2 from the layer before. The mask is a StaticCache's [T, S] one with every slot filled (the CUDA-graph decode
step's form). Each path runs all layers inside one captured CUDA graph, as decode does; the result is
microseconds per layer (per call) and over all layers. Paths (both from q_latent = q_nope W_uk to out_latent,
before W_uv, which they share):
  einsum    k3.ops.mla_decode.latent_attention_einsum: scores, mask, softmax, probabilities @ latent
  triton    k3.ops.mla_decode.latent_attention_triton_eager with its default blocks and split count, reading the
            mask; also a small sweep of BLOCK_S x num_warps, best printed (--no-sweep leaves it out)
  triton limits  the same kernel given the static cache's visible_limits instead of its mask (what the decode
            step passes): no mask load per block
Paged (the engine's cache pool: pages of 32 slots, each row's pages shuffled through the pool, its table padded
to the context + 320 slots as the engine pads to its longest context, every row at the last position):
  gathered  k3.ops.mla_decode.latent_attention_paged_einsum: the rows' pages copied out, then the einsum (the
            engine's path before the paged kernel, and still its K3_MLA_DECODE=einsum path)
  paged     k3.ops.mla_decode.latent_attention_paged_triton_eager: the kernel reading the pool in place
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

from k3.ops.mla_decode import (PagedLatents, default_block_s, latent_attention_einsum, latent_attention_paged_einsum,
                                latent_attention_paged_triton_eager, latent_attention_triton_eager, num_splits,
                                programs_per_sm)

HEADS, RANK, ROPE, NOPE = 8, 256, 64, 64  # `small`
SCALE = (NOPE + ROPE) ** -0.5
SWEEP_S = (32, 64, 128)
SWEEP_WARPS = (4, 8)
# --wide-sweep: also the software-pipelining depth and more KV splits than the heuristic's (x2, x4: more
# programs per multiprocessor, so more loads in flight), at the block sizes a batch of rows favours.
WIDE_S = (16, 32, 64)
WIDE_WARPS = (2, 4, 8)
WIDE_STAGES = (2, 3, 4, 5)
WIDE_SPLIT_FACTORS = (1, 2, 4)
PAGE = 32  # the engine's default page size
TABLE_PAD = 320  # slots of table padding past the context (the engine's tables reach its max_context)


def sweep_grid(wide: bool, batch: int, context: int, num_sms: int) -> dict[str, dict]:
    """Launch configs by label: BLOCK_S/warps, and with `wide` /stages/splits."""
    if not wide:
        return {f"{s}/{w}": dict(block_s=s, num_warps=w) for s in SWEEP_S for w in SWEEP_WARPS}
    grid = {}
    for s in WIDE_S:
        base = num_splits(batch, context, s, num_sms)[0]
        for w in WIDE_WARPS:
            for st in WIDE_STAGES:
                for f in WIDE_SPLIT_FACTORS:
                    if (s == 16) != (w == 2):  # 2 warps only with 16-slot blocks, where they fit the tile
                        continue
                    grid[f"{s}/{w}/{st}/{base * f}"] = dict(block_s=s, num_warps=w, num_stages=st, splits=base * f)
    return grid


def bench_case(batch: int, context: int, layers: int, bandwidth: float, sweep: bool, wide: bool = False,
               sweep_form: str = "mask") -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    caches = [(torch.randn(batch, context, RANK, device="cuda", generator=gen).bfloat16(),
               torch.randn(batch, context, ROPE, device="cuda", generator=gen).bfloat16()) for _ in range(layers)]
    queries = [(torch.randn(batch, HEADS, 1, RANK, device="cuda", generator=gen).div_(4).bfloat16(),
                torch.randn(batch, 1, HEADS, ROPE, device="cuda", generator=gen).bfloat16()) for _ in range(layers)]
    position = torch.tensor(context - 1, device="cuda")  # StaticMLASlot.append's mask, every slot filled
    mask = torch.arange(context, device="cuda")[None, :] <= position + torch.arange(1, device="cuda")[:, None]

    def einsum(i):
        return latent_attention_einsum(*queries[i], *caches[i], mask, 0, SCALE)

    limits = (position + 1).to(torch.int32).expand(batch)  # StaticMLASlot.visible_limits: the same slots

    def triton_with(form=None, **launch):
        def run(i):
            if (form or sweep_form) == "limits":
                return latent_attention_triton_eager(*queries[i], *caches[i], None, 0, SCALE, limits_B=limits,
                                                     **launch)
            return latent_attention_triton_eager(*queries[i], *caches[i], mask, 0, SCALE, **launch)
        return run

    want = latent_attention_einsum(*(t.float() for t in queries[0] + caches[0]), mask, 0, SCALE)
    errors = dict(einsum_rel_err=relative_error(einsum(0).float(), want),
                  triton_rel_err=relative_error(triton_with("mask")(0).float(), want),
                  triton_limits_rel_err=relative_error(triton_with("limits")(0).float(), want))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_s = default_block_s(batch, RANK)  # what the launcher picks by default (one head block: 8 heads)
    splits = num_splits(batch, context, block_s, num_sms, programs_per_sm(block_s))[0]
    result = dict(batch=batch, context=context, layers=layers, splits=splits, **errors)
    print(f"B={batch} S={context}: rel err einsum {errors['einsum_rel_err']:.2e} triton "
          f"{errors['triton_rel_err']:.2e}, {splits} splits", flush=True)
    result["einsum_us"] = graph_us_per_layer(einsum, layers)
    print(f"  einsum {result['einsum_us']:.1f} us", flush=True)
    result["triton_us"] = graph_us_per_layer(triton_with("mask"), layers)
    print(f"  triton (mask) {result['triton_us']:.1f} us", flush=True)
    result["triton_limits_us"] = graph_us_per_layer(triton_with("limits"), layers)
    print(f"  triton (limits) {result['triton_limits_us']:.1f} us, rel err {errors['triton_limits_rel_err']:.1e}",
          flush=True)
    swept, swept_err = {}, {}
    for label, launch in (sweep_grid(wide, batch, context, num_sms).items() if sweep else ()):
        try:
            swept_err[label] = relative_error(triton_with(**launch)(0).float(), want)
            swept[label] = graph_us_per_layer(triton_with(**launch), layers)
        except Exception as exc:  # a block size the compiler rejects (shared memory) is skipped, said
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if wide:
            print(f"  {label}: {swept[label]:.1f} us, rel err {swept_err[label]:.1e}", flush=True)
    # A config only counts where it computes the same thing (a failed pipelining would show here first).
    swept = {k: v for k, v in swept.items() if swept_err[k] <= max(1e-2, 2 * errors["einsum_rel_err"])}
    best = min(swept, key=swept.get) if swept else "-"
    floor_us = batch * context * (RANK + ROPE) * 2 / bandwidth * 1e6
    result.update(sweep_us=swept, best=best, best_us=swept.get(best, result["triton_us"]), floor_us=floor_us,
                  einsum_vs_floor=result["einsum_us"] / floor_us, triton_vs_floor=result["triton_us"] / floor_us,
                  triton_limits_vs_floor=result["triton_limits_us"] / floor_us,
                  speedup=result["einsum_us"] / result["triton_us"])
    print(f"B={batch} S={context}: einsum {result['einsum_us']:.1f} us, triton {result['triton_us']:.1f} us "
          f"(best BLOCK_S/warps {best}: {result['best_us']:.1f}), floor {floor_us:.1f} us, speed-up "
          f"{result['speedup']:.2f}x, triton / floor {result['triton_vs_floor']:.2f}x (limits "
          f"{result['triton_limits_vs_floor']:.2f}x)", flush=True)
    return result


def bench_paged_case(batch: int, context: int, layers: int, bandwidth: float) -> dict:
    """The engine's pool: gathered twin against the in-place kernel, per layer, one graph over the layers."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 11 + context)
    width = -(-(context + TABLE_PAD) // PAGE)
    used = -(-context // PAGE)
    pools, pages = [], []
    for _ in range(layers):
        latent = torch.randn(batch * used + 1, PAGE, RANK, device="cuda", generator=gen).bfloat16()
        k_rope = torch.randn(batch * used + 1, PAGE, ROPE, device="cuda", generator=gen).bfloat16()
        table = torch.zeros(batch, width, dtype=torch.long, device="cuda")  # padding: page 0 (scratch)
        table[:, :used] = 1 + torch.randperm(batch * used, device="cuda", generator=gen).view(batch, used)
        pools.append((latent, k_rope))
        pages.append(PagedLatents(latent, k_rope, table, torch.full((batch,), context - 1, device="cuda")))
    queries = [(torch.randn(batch, HEADS, 1, RANK, device="cuda", generator=gen).div_(4).bfloat16(),
                torch.randn(batch, 1, HEADS, ROPE, device="cuda", generator=gen).bfloat16()) for _ in range(layers)]

    def gathered(i):
        return latent_attention_paged_einsum(*queries[i], pages[i], SCALE)

    def paged(i):
        return latent_attention_paged_triton_eager(*queries[i], *pages[i], SCALE)

    fp32 = PagedLatents(pages[0].latent_NPR.float(), pages[0].k_rope_NPE.float(), *pages[0][2:])
    want = latent_attention_paged_einsum(*(t.float() for t in queries[0]), fp32, SCALE)
    result = dict(batch=batch, context=context, layers=layers, table_pages=width,
                  gathered_rel_err=relative_error(gathered(0).float(), want),
                  paged_rel_err=relative_error(paged(0).float(), want))
    result["gathered_us"] = graph_us_per_layer(gathered, layers)
    result["paged_us"] = graph_us_per_layer(paged, layers)
    floor_us = batch * context * (RANK + ROPE) * 2 / bandwidth * 1e6
    result.update(floor_us=floor_us, speedup=result["gathered_us"] / result["paged_us"],
                  paged_vs_floor=result["paged_us"] / floor_us)
    print(f"paged B={batch} S={context} (table {width} pages): gathered {result['gathered_us']:.1f} us, paged "
          f"{result['paged_us']:.1f} us, speed-up {result['speedup']:.2f}x, paged / floor "
          f"{result['paged_vs_floor']:.2f}x, rel err {result['gathered_rel_err']:.1e} / "
          f"{result['paged_rel_err']:.1e}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--context", nargs="+", type=int, default=[8192, 131072])
    parser.add_argument("--layers", type=int, default=4, help="distinct caches (small has 4 MLA layers)")
    parser.add_argument("--no-sweep", action="store_true", help="time only the default blocks")
    parser.add_argument("--wide-sweep", action="store_true",
                        help="sweep BLOCK_S x warps x pipelining stages x KV splits (x1, x2, x4 the heuristic's), "
                             "each config checked against the fp32 einsum and printed")
    parser.add_argument("--sweep-form", choices=["mask", "limits"], default="mask",
                        help="the visible slots as the swept kernel reads them: the static cache's [T, S] mask or "
                             "its [B] limits (no mask load, unfilled blocks not visited)")
    parser.add_argument("--no-paged", action="store_true", help="leave out the engine's paged pool")
    parser.add_argument("--out", "--json", dest="json", default=None, help="write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/mla_decode.py needs a CUDA device")
    bandwidth = copy_bandwidth()
    print(f"{device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results, paged, failed = [], [], []
    for batch in args.batch:
        for context in args.context:
            cases = [(results, lambda: bench_case(batch, context, args.layers, bandwidth, not args.no_sweep,
                                                          args.wide_sweep, args.sweep_form))]
            if not args.no_paged:
                cases.append((paged, lambda: bench_paged_case(batch, context, args.layers, bandwidth)))
            for into, case in cases:
                try:
                    into.append(case())
                except Exception as exc:  # out of memory at a big case must not lose the others
                    failed.append(dict(batch=batch, context=context, paged=into is paged,
                                       error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                    print(f"B={batch} S={context} failed: {failed[-1]['error']}", flush=True)
                torch.cuda.empty_cache()
                write_json(args.json, dict(device=device_name(), bandwidth_bytes_per_s=bandwidth, results=results,
                                           paged=paged, failed=failed, partial=True))
    if results:
        print_table(f"absorbed MLA decode attention per layer (small: {HEADS} heads, R {RANK}, rope {ROPE}, bf16, "
                    f"one query), one CUDA graph over {args.layers} layers",
                    ["batch", "context", "splits", "einsum us", "triton us", "triton limits us", "speed-up",
                     "best sweep", "floor us", "einsum / floor", "triton / floor", "limits / floor",
                     f"triton x{args.layers} us",
                     "rel err"],
                    [[r["batch"], r["context"], r["splits"], f"{r['einsum_us']:.1f}", f"{r['triton_us']:.1f}",
                      f"{r['triton_limits_us']:.1f}", f"{r['speedup']:.2f}x", f"{r['best']} {r['best_us']:.1f}",
                      f"{r['floor_us']:.1f}",
                      f"{r['einsum_vs_floor']:.2f}x", f"{r['triton_vs_floor']:.2f}x",
                      f"{r['triton_limits_vs_floor']:.2f}x",
                      f"{r['triton_us'] * args.layers:.1f}", f"{r['triton_rel_err']:.1e}"] for r in results])
    if paged:
        print_table(f"absorbed MLA decode attention per layer over the engine's pool ({PAGE}-slot pages), one CUDA "
                    f"graph over {args.layers} layers",
                    ["batch", "context", "table pages", "gathered us", "paged us", "speed-up", "floor us",
                     "paged / floor", "rel err"],
                    [[r["batch"], r["context"], r["table_pages"], f"{r['gathered_us']:.1f}", f"{r['paged_us']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['floor_us']:.1f}", f"{r['paged_vs_floor']:.2f}x",
                      f"{r['paged_rel_err']:.1e}"] for r in paged])
    write_json(args.json, dict(device=device_name(), bandwidth_bytes_per_s=bandwidth, results=results,
                               paged=paged, failed=failed))
    bad = [r for r in results
           if max(r["triton_rel_err"], r["triton_limits_rel_err"]) > max(1e-2, 2 * r["einsum_rel_err"])]
    bad += [r for r in paged if r["paged_rel_err"] > max(1e-2, 2 * r["gathered_rel_err"])]
    if bad:
        sys.exit(f"Triton kernel too far from the fp32 einsum: {[(r['batch'], r['context']) for r in bad]}")


if __name__ == "__main__":
    main()
