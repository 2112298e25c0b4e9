"""Routed experts of a decode step on one GPU: k3's Triton kernels against torch._grouped_mm, in one run.

Usage: python bench/moe_decode.py [--models small matched] [--tokens 1 8 64 256] [--layers 15] [--launch-sweep]
       [--dense] [--routing] [--router] [--skip-experts] [--pair-blocks 256 512] [--out FILE]

For each model's expert shapes (`small`: 64 experts, top-6, latent 512, width 1024, SiTU; `matched`: 64 experts,
top-6, hidden 1024, width 512, SiLU) and each token count: routing is top-k of random scores, and `--layers`
distinct layers of expert weights exist, so that no layer finds its weights in L2 from the layer before (a decode
step runs every MoE layer once). Each path runs all layers inside one captured CUDA graph, as decode does; the
result is microseconds per layer. Paths:
  grouped   what decode ran before: gate and up as one torch._grouped_mm over the fused [E, 2F, D] buffer, the
            GLU, the down grouped GEMM (k3.ops.moe.experts_grouped_mm with w13)
  triton    k3.ops.moe_triton with its default block sizes; also every block size of a small sweep, best printed
With --dense, also `small`'s dense decode projections (one weight [out, in] per layer, `--layers` of them), up to
SKINNY_MAX_ROWS (64) tokens:
  linear    torch.nn.functional.linear (cuBLAS)
  triton    k3.ops.linear_triton's skinny kernel, default and swept blocks, warps and stages; and an empty Triton
            kernel, the fixed cost of one launch inside a graph
With --routing, also the routing steps as a compiled decode step runs them (torch.compile, Inductor), old form
against new in one CUDA graph over all layers: top-k of the biased scores (torch.topk against k rounds of
argmax-and-mask, which k3 tried and does not use: it was slower) and the sort of the pairs by expert (argsort +
inverse + counts against k3.ops.moe.sort_pairs_by_expert, a counting sort); both outputs checked equal.
With --router, `small`'s router: the compiled fp32 logits as a matmul against a product-and-sum reduction, and the
route kernel over (tokens per program, warps). With --launch-sweep, the pair-order expert kernels' blocks, warps
and stages, one projection at a time. The pair-order kernels are also timed sharing each expert's pair list
(the first stores it, the second loads it: K3_MOE_PAIR_LISTS=1).
The floor is the bytes of the touched experts' weights (plus the rows in and out) over the copy bandwidth
measured in the same run. Before timing, each path is compared with the fp32 loop over experts (relative error);
the script exits 1 when the Triton path is further from it than both 1e-2 and twice the grouped GEMM's error.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import copy_bandwidth, device_name, graph_us_per_layer, print_table, relative_error, write_json

from k3 import kernels
from k3.ops import moe_triton
from k3.ops.linear_triton import SKINNY_MAX_ROWS
from k3.ops.moe import experts_grouped_mm, experts_in_pair_order, experts_loop
from k3.ops.moe_triton import block_sizes, experts_by_ids_eager, experts_triton_eager

SHAPES = {  # experts, top-k, expert width F, input width D, activation
    "small": (64, 6, 1024, 512, "situ"),
    "matched": (64, 6, 512, 1024, "silu"),
}
SWEEP_N = (16, 32, 64, 128)
SWEEP_K = (64, 128, 256)
# With --launch-sweep, the pair-order kernels (what decode runs up to 512 pairs) over (BLOCK_N, BLOCK_K) x
# (num_warps, num_stages), one projection at a time with the other at its default; (4, 3) is Triton's default.
LAUNCH_BLOCKS = ((16, 128), (32, 128), (32, 256), (64, 128), (16, 256))
LAUNCH_WARPS_STAGES = ((4, 3), (2, 3), (8, 3), (4, 2), (4, 5))


def bench_case(model: str, tokens: int, layers: int, bandwidth: float, launch_sweep: bool = False,
               pair_blocks: tuple[int, ...] = ()) -> dict:
    experts, top_k, width_f, width_d, act = SHAPES[model]
    betas = (4.0, 25.0)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = [torch.randn(experts, 2 * width_f, width_d, device="cuda", generator=gen).div_(width_d ** 0.5).bfloat16()
           for _ in range(layers)]
    w2 = [torch.randn(experts, width_d, width_f, device="cuda", generator=gen).div_(width_f ** 0.5).bfloat16()
          for _ in range(layers)]
    scores = torch.rand(tokens, experts, device="cuda", generator=gen)
    ids = scores.topk(top_k, dim=-1).indices.reshape(-1)
    order = ids.argsort(stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device="cuda").scatter_add_(0, ids, torch.ones_like(ids))
    x = torch.randn(tokens, width_d, device="cuda", generator=gen).bfloat16()[order // top_k].contiguous()

    def views(i):
        return w13[i][:, :width_f], w13[i][:, width_f:], w2[i]

    w1_0, w3_0, w2_0 = views(0)
    want = experts_loop(x.float(), counts.tolist(), w1_0.float(), w3_0.float(), w2_0.float(), act, betas)
    grouped_out = experts_grouped_mm(x, counts, w1_0, w3_0, w2_0, act, betas, w13[0])
    triton_out = experts_triton_eager(x, counts, w1_0, w3_0, w2_0, act, betas)
    errors = dict(grouped_rel_err=relative_error(grouped_out.float(), want),
                  triton_rel_err=relative_error(triton_out.float(), want))

    def grouped(i):
        w1, w3, w2_i = views(i)
        experts_grouped_mm(x, counts, w1, w3, w2_i, act, betas, w13[i])

    def triton_with(blocks):
        def run(i):
            w1, w3, w2_i = views(i)
            experts_triton_eager(x, counts, w1, w3, w2_i, act, betas, blocks)
        return run

    # From the routed ids to rows in pair order: sort, gather, the sorted kernels and unpermute (what decode ran
    # before) against the pair-order kernels, which find each expert's pairs themselves.
    h = torch.randn(tokens, width_d, device="cuda", generator=gen).bfloat16()

    def sorted_from_ids(i):
        w1, w3, w2_i = views(i)
        return experts_in_pair_order(h, ids, top_k, w1, w3, w2_i, act, betas)

    def pair_order_with(blocks=None, shared_lists=False):
        def run(i):
            w1, w3, w2_i = views(i)
            return experts_by_ids_eager(h, ids, w1, w3, w2_i, act, betas, blocks, shared_lists)
        return run

    pair_order = pair_order_with()

    with kernels.use(moe="grouped"):
        want_pairs = experts_loop(h.float()[ids.argsort(stable=True) // top_k], counts.tolist(), w1_0.float(),
                                  w3_0.float(), w2_0.float(), act, betas)[torch.argsort(ids.argsort(stable=True))]
        errors["pair_order_rel_err"] = relative_error(pair_order(0).float(), want_pairs)
        grouped_from_ids_us = graph_us_per_layer(sorted_from_ids, layers)
    pair_order_us = graph_us_per_layer(pair_order, layers)
    # The second kernel loading the pair lists the first stored, instead of scanning the ids again.
    shared = pair_order_with(shared_lists=True)
    errors["pair_lists_rel_err"] = relative_error(shared(0).float(), want_pairs)
    pair_lists_us = graph_us_per_layer(shared, layers)
    pair_block_us = {}
    default_pair_block = moe_triton.PAIR_BLOCK
    try:
        for block_p in pair_blocks:
            moe_triton.PAIR_BLOCK = block_p
            pair_block_us[block_p] = graph_us_per_layer(pair_order, layers)
    finally:
        moe_triton.PAIR_BLOCK = default_pair_block

    rows = x.shape[0]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = (block_sizes(rows, experts, width_f, width_d, num_sms), block_sizes(rows, experts, width_d, width_f,
                                                                                   num_sms))
    result = dict(model=model, tokens=tokens, rows=rows, experts_touched=int((counts > 0).sum()), **errors,
                  default_blocks=default, grouped_from_ids_us=grouped_from_ids_us, pair_order_us=pair_order_us,
                  pair_lists_us=pair_lists_us, pair_block_us=pair_block_us)
    result["grouped_us"] = graph_us_per_layer(grouped, layers)
    result["triton_us"] = graph_us_per_layer(triton_with(default), layers)
    sweep = {}
    for block_n in SWEEP_N:
        for block_k in SWEEP_K:
            blocks = ((16, block_n, block_k), (16, block_n, block_k))
            try:
                sweep[f"{block_n}x{block_k}"] = graph_us_per_layer(triton_with(blocks), layers)
            except Exception as exc:  # a block size the compiler rejects (shared memory) is skipped, said
                print(f"  blocks {blocks}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    best = min(sweep, key=sweep.get)
    if launch_sweep:
        result["launch_sweep_us"] = sweep_launches(lambda blocks: graph_us_per_layer(pair_order_with(blocks), layers),
                                                   default)
    touched = result["experts_touched"]
    weight_bytes = touched * 3 * width_f * width_d * 2
    io_bytes = rows * (width_d * 2 + width_f * 2) * 2
    floor_us = (weight_bytes + io_bytes) / bandwidth * 1e6
    result.update(sweep_us=sweep, best_blocks=best, best_us=sweep[best], floor_us=floor_us,
                  grouped_vs_floor=result["grouped_us"] / floor_us, triton_vs_floor=result["triton_us"] / floor_us,
                  speedup=result["grouped_us"] / result["triton_us"])
    print(f"{model} x{tokens}: from ids, sorted + grouped {grouped_from_ids_us:.1f} us, pair-order kernels "
          f"{pair_order_us:.1f} us (rel err {errors['pair_order_rel_err']:.1e}), sharing the pair lists "
          f"{pair_lists_us:.1f} us (rel err {errors['pair_lists_rel_err']:.1e})"
          + "".join(f"; ids scanned {p} at a time {us:.1f} us" for p, us in pair_block_us.items()), flush=True)
    print(f"{model} x{tokens}: grouped {result['grouped_us']:.1f} us, triton {result['triton_us']:.1f} us "
          f"(best {best}: {sweep[best]:.1f}), floor {floor_us:.1f} us; rel err grouped "
          f"{errors['grouped_rel_err']:.2e} triton {errors['triton_rel_err']:.2e}", flush=True)
    return result


def sweep_launches(timed, default) -> dict:
    """timed(blocks) -> us per layer of the pair-order kernels, for each launch config of one projection
    ("gate_up" or "down") with the other at its default blocks; the best of each, and both bests ("both")."""
    out = {"default": timed(default)}
    best = {}
    for which in ("gate_up", "down"):
        for block_n, block_k in LAUNCH_BLOCKS:
            for warps, stages in LAUNCH_WARPS_STAGES:
                config = (16, block_n, block_k, warps, stages)
                blocks = (config, default[1]) if which == "gate_up" else (default[0], config)
                key = f"{which} {block_n}x{block_k} w{warps} s{stages}"
                try:
                    out[key] = timed(blocks)
                except Exception as exc:  # shared memory or registers over the limit: said, skipped
                    print(f"  {key}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                if which not in best or out[key] < out[best[which][0]]:
                    best[which] = (key, config)
        print(f"  best {which}: {best[which][0]} {out[best[which][0]]:.1f} us (default {out['default']:.1f})",
              flush=True)
    out["both"] = timed((best["gate_up"][1], best["down"][1]))
    out["best_gate_up"], out["best_down"] = best["gate_up"][1], best["down"][1]
    print(f"  both bests: {out['both']:.1f} us", flush=True)
    return out


DENSE = {  # `small`'s projections that read one token's hidden state in decode (fused groups as one weight)
    "kda_in (q k v f_a g b)": (4232, 1024), "shared gate+up": (2048, 1024), "o_proj": (1024, 1024),
    "latent down": (512, 1024), "latent up": (1024, 512), "f_b": (1024, 128), "lm_head": (32768, 1024),
    # the MoE projection groups of k3.layers.fused_weights (frozen models)
    "moe input (latent down + shared gate/up)": (2560, 1024), "moe output (latent up + shared down)": (1024, 1536),
}


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of k3.ops.linear_triton's skinny kernel; BLOCK_K 0 = the whole row
# (up to 16 rows only: past that the x tile of a whole row outgrows shared memory).
DENSE_SWEEP = ((16, 256, 4, 3), (32, 256, 4, 3), (16, 128, 2, 4), (16, 512, 4, 2), (32, 0, 4, 1), (16, 0, 4, 1),
               (64, 128, 4, 4), (8 * 4, 64, 1, 4))
# Past 16 rows (BLOCK_M 32 or 64): narrower K steps, more warps for the larger tile.
DENSE_SWEEP_ROWS = ((16, 128, 4, 3), (32, 128, 4, 3), (16, 64, 4, 4), (32, 64, 4, 4), (64, 64, 4, 3),
                    (16, 128, 8, 3), (32, 128, 8, 4), (16, 256, 4, 2))


def bench_dense(name: str, tokens: int, layers: int, bandwidth: float) -> dict:
    """One dense projection per layer: cuBLAS (F.linear) against k3.ops.linear_triton's skinny kernel swept over
    DENSE_SWEEP, and an empty Triton kernel per layer for the fixed cost of a launch inside a graph."""
    from k3.ops.linear_triton import skinny_linear_eager

    out_width, in_width = DENSE[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    count = 1 if name == "lm_head" else layers
    weights = [torch.randn(out_width, in_width, device="cuda", generator=gen).div_(in_width ** 0.5).bfloat16()
               for _ in range(count)]
    x = torch.randn(tokens, in_width, device="cuda", generator=gen).bfloat16()
    want = x.float() @ weights[0].float().t()
    result = dict(name=name, tokens=tokens, out_width=out_width, in_width=in_width,
                  linear_rel_err=relative_error(torch.nn.functional.linear(x, weights[0]).float(), want),
                  triton_rel_err=relative_error(skinny_linear_eager(x, weights[0]).float(), want))
    result["linear_us"] = graph_us_per_layer(lambda i: torch.nn.functional.linear(x, weights[i]), count)
    result["triton_us"] = graph_us_per_layer(lambda i: skinny_linear_eager(x, weights[i]), count)
    sweep = {}
    for block_n, block_k, warps, stages in DENSE_SWEEP if tokens <= 16 else DENSE_SWEEP_ROWS:
        block_k = block_k or 1 << (in_width - 1).bit_length()
        key = f"{block_n}x{block_k}w{warps}s{stages}"
        try:
            sweep[key] = graph_us_per_layer(lambda i: skinny_linear_eager(x, weights[i], block_n, block_k, warps,
                                                                          stages), count)
        except Exception as exc:
            print(f"  {key}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    best = min(sweep, key=sweep.get)
    floor_us = (out_width * in_width + tokens * (in_width + out_width)) * 2 / bandwidth * 1e6
    result.update(sweep_us=sweep, best_blocks=best, best_us=sweep[best], floor_us=floor_us,
                  speedup=result["linear_us"] / result["triton_us"], best_speedup=result["linear_us"] / sweep[best])
    print(f"{name} x{tokens}: linear {result['linear_us']:.1f} us, triton {result['triton_us']:.1f} us "
          f"(best {best}: {sweep[best]:.1f}), floor {floor_us:.1f} us", flush=True)
    return result


def empty_launch_us(layers: int) -> float:
    """A Triton kernel that stores one number, once per layer in one graph: the fixed cost of a launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_one(out_ptr):
        tl.store(out_ptr + tl.program_id(0), 1.0)

    out = torch.empty(132, device="cuda")
    return graph_us_per_layer(lambda i: store_one[(132,)](out), layers)


def topk_by_argmax_rounds(values, k):
    picked = []
    for _ in range(k):
        index = values.argmax(-1, keepdim=True)
        picked.append(index)
        values = values.scatter(-1, index, float("-inf"))
    return torch.cat(picked, -1)


def old_sort(ids, num_experts):
    from k3.ops.moe import count_per_expert, inverse_permutation

    order = ids.argsort(stable=True)
    return order, inverse_permutation(order), count_per_expert(ids, num_experts)


def bench_routing(tokens: int, layers: int, experts: int = 64, top_k: int = 6) -> dict:
    from k3.ops.moe import sort_pairs_by_expert

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    scores = [torch.rand(tokens, experts, device="cuda", generator=gen) for _ in range(layers)]
    ids = [s.topk(top_k, dim=-1).indices.reshape(-1) for s in scores]
    paths = dict(topk_old=torch.compile(lambda v: v.topk(top_k, dim=-1).indices, dynamic=False),
                 topk_new=torch.compile(lambda v: topk_by_argmax_rounds(v, top_k), dynamic=False),
                 sort_old=torch.compile(lambda i: old_sort(i, experts), dynamic=False),
                 sort_new=torch.compile(lambda i: sort_pairs_by_expert(i, experts), dynamic=False))
    same_topk = torch.equal(paths["topk_old"](scores[0]), paths["topk_new"](scores[0]))
    same_sort = all(torch.equal(a, b) for a, b in zip(paths["sort_old"](ids[0]), paths["sort_new"](ids[0])))
    result = dict(tokens=tokens, same_topk=same_topk, same_sort=same_sort)
    for name, fn in paths.items():
        inputs = scores if name.startswith("topk") else ids
        result[f"{name}_us"] = graph_us_per_layer(lambda i: fn(inputs[i]), layers)
    print(f"routing x{tokens}: topk {result['topk_old_us']:.1f} -> {result['topk_new_us']:.1f} us, sort "
          f"{result['sort_old_us']:.1f} -> {result['sort_new_us']:.1f} us, equal {same_topk} {same_sort}", flush=True)
    return result


ROUTE_LAUNCHES = ((16, 4), (16, 2), (16, 1), (4, 1), (4, 2))  # (tokens per program, warps); (4, 2) default


def bench_router(tokens: int, layers: int, hidden: int = 1024, experts: int = 64, top_k: int = 6) -> dict:
    """`small`'s router per MoE layer in one CUDA graph over all layers: the fp32 logits compiled as a matmul
    (cuBLAS) and as a product and a sum (one Inductor reduction, k3.layers.moe.COMPILED_LOGITS_MAX_TOKENS), then
    the route kernel (k3.ops.route_triton) over launch configs."""
    from k3.layers.moe import logits_as_reduction
    from k3.ops.route_triton import route_triton_eager

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16() for _ in range(layers)]
    ws = [torch.randn(experts, hidden, device="cuda", generator=gen).div_(hidden ** 0.5).bfloat16()
          for _ in range(layers)]
    bias = torch.zeros(experts, device="cuda")
    matmul = torch.compile(lambda x, w: x.float() @ w.float().t(), dynamic=False)
    reduction = torch.compile(logits_as_reduction, dynamic=False)
    want = xs[0].double() @ ws[0].double().t()
    result = dict(tokens=tokens, logits_matmul_rel_err=relative_error(matmul(xs[0], ws[0]).double(), want),
                  logits_reduction_rel_err=relative_error(reduction(xs[0], ws[0]).double(), want))
    result["logits_matmul_us"] = graph_us_per_layer(lambda i: matmul(xs[i], ws[i]), layers)
    result["logits_reduction_us"] = graph_us_per_layer(lambda i: reduction(xs[i], ws[i]), layers)
    logits = [matmul(x, w) for x, w in zip(xs, ws)]
    ids0 = route_triton_eager(logits[0], bias, top_k, True, 2.5)[0]
    for block_t, warps in ROUTE_LAUNCHES:
        if block_t < 16 and tokens > 64:
            continue
        same = torch.equal(route_triton_eager(logits[0], bias, top_k, True, 2.5, block_t, warps)[0], ids0)
        us = graph_us_per_layer(lambda i: route_triton_eager(logits[i], bias, top_k, True, 2.5, block_t, warps),
                                layers)
        result[f"route_{block_t}t_{warps}w_us"] = us
        result[f"route_{block_t}t_{warps}w_same"] = same
    print(f"router x{tokens}: logits matmul {result['logits_matmul_us']:.1f} us, reduction "
          f"{result['logits_reduction_us']:.1f} us; route " + ", ".join(
              f"{k[6:-3]} {v:.1f}" for k, v in result.items() if k.startswith("route_") and k.endswith("_us")),
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--routing", action="store_true", help="also the compiled routing steps, old against new")
    parser.add_argument("--skip-experts", action="store_true", help="leave out the routed-expert cases")
    parser.add_argument("--dense", action="store_true", help="also the dense decode projections (skinny GEMMs)")
    parser.add_argument("--router", action="store_true",
                        help="also the router: compiled logits as matmul / reduction, the route kernel's launches")
    parser.add_argument("--launch-sweep", action="store_true",
                        help="also sweep the pair-order kernels' blocks, warps and stages per projection")
    parser.add_argument("--pair-blocks", nargs="+", type=int, default=[],
                        help="also time the pair-order kernels scanning the routed ids this many at a time "
                             "(k3.ops.moe_triton.PAIR_BLOCK)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_decode.py needs a CUDA device")
    bandwidth = copy_bandwidth()
    print(f"{device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    routing = [bench_routing(t, args.layers) for t in args.tokens] if args.routing else []
    if routing:
        print_table("compiled routing per MoE layer (64 experts, top-6), one CUDA graph over all layers",
                    ["tokens", "topk us", "argmax rounds us", "argsort us", "counting sort us", "equal"],
                    [[r["tokens"], f"{r['topk_old_us']:.1f}", f"{r['topk_new_us']:.1f}", f"{r['sort_old_us']:.1f}",
                      f"{r['sort_new_us']:.1f}", r["same_topk"] and r["same_sort"]] for r in routing])
    router = [bench_router(t, args.layers) for t in args.tokens] if args.router else []
    results = [] if args.skip_experts else [bench_case(m, t, args.layers, bandwidth, args.launch_sweep,
                                                       tuple(args.pair_blocks))
                                            for m in args.models for t in args.tokens]
    if results:
        print_table("routed experts per MoE layer, one CUDA graph over all layers",
                    ["model", "tokens", "experts", "grouped us", "triton us", "speed-up", "best sweep", "floor us",
                     "triton / floor", "rel err", "ids->rows: sort+grouped us", "pair-order us",
                     "pair-order, shared lists us"],
                    [[r["model"], r["tokens"], r["experts_touched"], f"{r['grouped_us']:.1f}", f"{r['triton_us']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['best_blocks']} {r['best_us']:.1f}", f"{r['floor_us']:.1f}",
                      f"{r['triton_vs_floor']:.2f}x", f"{r['triton_rel_err']:.1e}", f"{r['grouped_from_ids_us']:.1f}",
                      f"{r['pair_order_us']:.1f}", f"{r['pair_lists_us']:.1f}"] for r in results])
    dense = []
    if args.dense:
        empty_us = empty_launch_us(args.layers)
        print(f"empty Triton kernel in a graph: {empty_us:.2f} us per launch", flush=True)
        dense = [bench_dense(n, t, args.layers, bandwidth) for n in DENSE for t in args.tokens
                 if t <= SKINNY_MAX_ROWS]
        print_table(f"dense decode projections per layer, one CUDA graph over all layers (empty launch "
                    f"{empty_us:.2f} us)",
                    ["projection", "tokens", "linear us", "triton us", "best sweep", "best speed-up", "floor us",
                     "rel err"],
                    [[r["name"], r["tokens"], f"{r['linear_us']:.1f}", f"{r['triton_us']:.1f}",
                      f"{r['best_blocks']} {r['best_us']:.1f}", f"{r['best_speedup']:.2f}x", f"{r['floor_us']:.1f}",
                      f"{r['triton_rel_err']:.1e}"] for r in dense])
    if args.out:
        write_json(args.out, dict(device=device_name(), bandwidth_bytes_per_s=bandwidth, results=results,
                                  dense=dense, routing=routing, router=router))
    bad = [r for r in results
           if max(r["triton_rel_err"], r["pair_order_rel_err"], r["pair_lists_rel_err"])
           > max(1e-2, 2 * r["grouped_rel_err"])]
    if bad:
        sys.exit(f"Triton path too far from the fp32 loop: {[(r['model'], r['tokens']) for r in bad]}")


if __name__ == "__main__":
    main()
