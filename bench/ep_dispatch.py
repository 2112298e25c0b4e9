"""Expert-parallel benchmark: dispatch/combine GB/s against plain all_to_all_single (same run), balanced vs plain
dispatch under skewed routing, and tokens/s of a model on 1 rank vs all ranks.

    torchrun --nproc-per-node 2 bench/ep_dispatch.py                      # GPUs (NCCL), `small` model
    torchrun --nproc-per-node 2 bench/ep_dispatch.py --cpu --tiny         # gloo functional run, tiny sizes

GB/s is per rank: bytes in the rank's send buffer (self-chunk included) / time, the same definition for the
baseline all_to_all_single (equal splits) and for dispatch/combine; "bus" multiplies by (R-1)/R (the part
that leaves the rank). Dispatch = permute + all_to_all + regroup by expert; combine = un-group + all_to_all +
un-permute; routing metadata (count all-gather, plan, permutations) is timed separately. Times are medians
over iterations of the slowest rank. Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from k3.config import ModelConfig
from k3.distributed import (balanced_plan, home_plan, imbalance, init_distributed, is_main, parallelize,
                            shutdown, train_steps)
from k3.distributed.dispatcher import combine, compute_slots, dispatch, route, slot_weights
from k3.model import K3ForCausalLM


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_median_seconds(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of fn() over iters on this rank; every rank starts each iteration together."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of fn() over iters, the slowest rank's."""
    median = torch.tensor([local_median_seconds(fn, device, warmup, iters)], dtype=torch.float64,
                          device=device)  # NCCL: on the GPU
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def say(*parts) -> None:
    if is_main():
        print(*parts, flush=True)


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def bench_all_to_all(sizes_mib: list[float], device, dtype, warmup: int, iters: int) -> dict[float, float]:
    world = dist.get_world_size()
    element = torch.tensor([], dtype=dtype).element_size()
    rates = {}
    for mib in sizes_mib:
        rows = max(world, int(mib * 2**20 / element / 1024) // world * world)
        send = torch.randn(rows, 1024, device=device).to(dtype)
        recv = torch.empty_like(send)
        seconds = timed(lambda: dist.all_to_all_single(recv, send), device, warmup, iters)
        rates[mib] = gbps(send.numel() * element, seconds)
        say(f"  all_to_all_single {mib:8.1f} MiB: {seconds * 1e3:8.3f} ms  {rates[mib]:7.1f} GB/s  "
            f"(bus {rates[mib] * (world - 1) / world:7.1f})")
    return rates


def routing_ids(tokens: int, experts: int, top_k: int, skew: float, device, generator) -> torch.Tensor:
    """[T, K] distinct expert ids per token; skew > 0 makes expert e's popularity ~ (e + 1) ** -skew
    (experts 0, 1, ... hottest: they all live on rank 0)."""
    popularity = (torch.arange(experts, dtype=torch.float64) + 1) ** -skew
    scores = torch.rand(tokens, experts, generator=generator, dtype=torch.float64).log() / popularity
    return scores.topk(top_k, dim=-1).indices.to(device)


def bench_dispatch(args, device, dtype, baseline: dict[float, float]) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(1234 + rank)
    experts_per_rank = args.experts // world
    h_TL = torch.randn(args.tokens, args.latent, device=device).to(dtype)
    w1 = torch.randn(experts_per_rank, args.expert_width, args.latent, device=device).to(dtype) * 0.02
    w3 = torch.randn_like(w1) * 0.02
    w2 = torch.randn(experts_per_rank, args.latent, args.expert_width, device=device).to(dtype) * 0.02
    element = h_TL.element_size()
    ids = routing_ids(args.tokens, args.experts, args.top_k, 0.0, device, generator)
    routed = route(ids, experts_per_rank, home_plan)
    x_slot = dispatch(h_TL, routed)
    num_bytes = ids.numel() * args.latent * element
    t_route = timed(lambda: route(ids, experts_per_rank, home_plan), device, args.warmup, args.iters)
    t_dispatch = timed(lambda: dispatch(h_TL, routed), device, args.warmup, args.iters)
    t_combine = timed(lambda: combine(x_slot, routed), device, args.warmup, args.iters)
    mib = num_bytes / 2**20
    say(f"\nuniform routing: {args.tokens} tokens/rank x top-{args.top_k}, latent {args.latent} {dtype}, "
        f"{args.experts} experts: {mib:.1f} MiB per rank each way")
    same = bench_all_to_all([mib], device, dtype, args.warmup, args.iters)[mib]
    for name, seconds in (("dispatch", t_dispatch), ("combine", t_combine)):
        rate = gbps(num_bytes, seconds)
        say(f"  {name:8s} {seconds * 1e3:8.3f} ms  {rate:7.1f} GB/s  = {100 * rate / same:5.1f}% of "
            f"all_to_all_single at the same size")
    say(f"  routing metadata (count all-gather + plan + permutations): {t_route * 1e3:.3f} ms")
    if baseline:
        say("  reference all_to_all_single rates: " + ", ".join(f"{m:g} MiB {r:.1f} GB/s" for m, r in baseline.items()))

    # Skewed routing: plain vs balanced, the whole routed step forward + backward.
    ids = routing_ids(args.tokens, args.experts, args.top_k, args.skew, device, generator)
    leaf_h = h_TL.detach().clone().requires_grad_(True)
    leaves = [w.detach().clone().requires_grad_(True) for w in (w1, w3, w2)]

    def step(plan_fn):
        def run():
            r = route(ids, experts_per_rank, plan_fn)
            weights = slot_weights(r, *leaves)
            y = combine(compute_slots(dispatch(leaf_h, r), r, *weights, "situ", (4.0, 25.0)), r)
            y.float().sum().backward()
            return r
        return run

    say(f"\nskewed routing (popularity ~ (e+1)^-{args.skew}), forward + backward of the routed experts:")
    times = {}
    for name, plan_fn in (("plain", home_plan), ("balanced", balanced_plan)):
        pairs = step(plan_fn)().plan.pairs_per_rank()
        times[name] = timed(step(plan_fn), device, args.warmup, args.iters)
        say(f"  {name:8s} {times[name] * 1e3:9.3f} ms   pairs per rank {pairs}  max/mean {imbalance(pairs):.3f}")
    say(f"  balanced / plain time: {times['balanced'] / times['plain']:.3f}")


def bench_model(args, device, dtype) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    config = ModelConfig.from_preset(args.model)

    def build() -> K3ForCausalLM:
        torch.manual_seed(0)
        with torch.device(device):
            return K3ForCausalLM(config).to(dtype)

    def tokens_per_second(model, global_rows: int, local: bool = False) -> float:
        """Train steps on global batches [global_rows, seq + 1]; the first step is a warm-up."""
        batches = [torch.randint(0, config.vocab_size, (global_rows, args.seq + 1),
                                 generator=torch.Generator().manual_seed(i)) for i in range(args.steps + 1)]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_steps(model, batches[:1], optimizer, local=local)
        sync(device)
        start = time.perf_counter()
        train_steps(model, batches[1:], optimizer, local=local)
        sync(device)
        return args.steps * global_rows * args.seq / (time.perf_counter() - start)

    single = torch.zeros(1, dtype=torch.float64)
    if rank == 0:  # rank 0 alone runs the plain single-device model on one rank's batch; the others wait
        model = build()
        single[0] = tokens_per_second(model, args.batch, local=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.broadcast(single, 0)
    model = parallelize(build(), ep_size=world, balanced=args.balanced_model)
    parallel = tokens_per_second(model, args.batch * world)
    say(f"\nmodel {args.model} ({dtype}), {args.batch} x {args.seq} tokens per rank, {args.steps} timed steps:")
    say(f"  1 rank: {single.item():10.1f} tokens/s")
    say(f"  {world} ranks (EP={world}, FSDP{', balanced' if args.balanced_model else ''}): "
        f"{parallel:10.1f} tokens/s   scaling efficiency {parallel / (world * single.item()):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (functional run)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and the debug model (CPU functional run)")
    parser.add_argument("--sizes-mib", type=float, nargs="*", default=[128, 1024],
                        help="plain all_to_all_single sizes per rank")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per rank for dispatch")
    parser.add_argument("--latent", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--expert-width", type=int, default=1024)
    parser.add_argument("--skew", type=float, default=1.2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--balanced-model", action="store_true", help="balanced dispatch in the model run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.sizes_mib, args.tokens, args.latent, args.experts = [1, 4], 256, 32, 8
        args.top_k, args.expert_width, args.model, args.batch, args.seq, args.steps = 2, 32, "debug", 2, 32, 2
        args.warmup, args.iters = 1, 3
    env = init_distributed(device="cpu" if args.cpu else None)
    if env.world_size < 2:
        raise SystemExit("run under torchrun with at least 2 processes, e.g. torchrun --nproc-per-node 2 ...")
    device = env.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    say(f"{env.world_size} ranks, backend {env.backend}, device {device.type}"
        + ("  [CPU functional run: not a performance result]" if device.type == "cpu" else ""))
    say("plain all_to_all_single:")
    baseline = bench_all_to_all(args.sizes_mib, device, dtype, args.warmup, args.iters)
    bench_dispatch(args, device, dtype, baseline)
    if not args.skip_model:
        bench_model(args, device, dtype)
    shutdown()  # not in a finally: its barrier would hang a rank whose peer raised
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
