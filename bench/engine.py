"""The inference engine in process: correctness of its fast paths, then throughput against one-by-one runs and
against the bare CUDA-graph decode step of bench/decode.py, all in one run.

Usage: python bench/engine.py [--preset small] [--prompt 1024] [--new 256] [--concurrency 1 16 64] [--no-checks]
       [--mla-backends einsum auto] [--out F]

Checks (printed as ok / FAIL with the numbers):
  graph-vs-eager   the same greedy requests with CUDA-graph decode and with the eager PyTorch step: tokens
                   agree and logprobs differ by at most --tol (bf16);
  batch-vs-alone   requests run together give the tokens each gives alone (greedy). In bf16 a different batch
                   shape rounds differently and a random-init MoE amplifies that through routing flips, so a
                   divergence passes where the alone run's top two logprobs were within --tol;
  batch-vs-alone-fp32  (CUDA) the same on an fp32 copy of the model, where batching must not change a token
                   (a divergence passes only at a top-two gap within --fp32-tol): this separates a batching bug
                   from bf16 rounding.
Timed (random weights, no EOS, every request runs its full --new tokens):
  engine at each concurrency C: C requests submitted at once; output tokens/s, time to first token and
  per-output-token time (p50 / p99), ratio of tokens/s to the one-by-one rate (C = 1);
  bare step: bench/decode.py's static cache + CUDAGraphDecoder at batch 1 and the same context: ms/token.
Also printed: the pool's bytes per request against context length (KDA constant, MLA by pages).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (add_kernels_argument, device_name, peak_memory_gib, print_table, synchronize,  # noqa: E402
                    write_json)

from k3 import K3ForCausalLM, ModelConfig, kernels  # noqa: E402
from k3.infer import Engine, SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def prompts_for(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def run_load(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit every prompt at once and step until all finish; per-request first-token and inter-token times."""
    synchronize()
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if event.token_id is None:
                continue
            tokens += 1
            if event.request_id not in first:
                first[event.request_id] = now - start
            else:
                gaps.append(now - last[event.request_id])
            last[event.request_id] = now
    elapsed = time.perf_counter() - start
    ttft = [first[r] * 1e3 for r in ids]
    return dict(requests=len(prompts), output_tokens=tokens, seconds=elapsed, output_tokens_per_s=tokens / elapsed,
                ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                tpot_p50_ms=percentile([g * 1e3 for g in gaps], 50), tpot_p99_ms=percentile([g * 1e3 for g in gaps], 99))


CHECKS = ("graph-vs-eager", "batch-vs-alone", "batch-vs-alone-fp32")


def check_graph_vs_eager(model, prompts, new: int, tol: float, max_context: int) -> dict:
    params = SamplingParams(max_new_tokens=new, temperature=0, logprobs=0)
    eager = Engine(model, None, max_context=max_context, max_batch=len(prompts), use_cuda_graphs=False)
    graph = Engine(model, None, max_context=max_context, max_batch=len(prompts))
    a = eager.complete(prompts, params)
    b = graph.complete(prompts, params)
    agree, diffs = 0, []
    for x, y in zip(a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        same = next((i for i, (p, q) in enumerate(zip(tx, ty)) if p != q), len(tx))
        agree += same == len(tx)
        # Compare logprobs up to the first disagreement (after it the contexts differ).
        diffs += [abs(p - q) for p, q in zip(x.outputs[0].logprobs[:same], y.outputs[0].logprobs[:same])]
    worst = max(diffs) if diffs else float("nan")
    return dict(requests=len(prompts), tokens_agree=agree, max_logprob_diff=worst,
                ok=agree == len(prompts) and worst <= tol)


def check_batch_vs_alone(model, prompts, new: int, max_context: int, tol: float) -> dict:
    """Greedy tokens together vs alone. In bf16 a different batch shape may round a near-tie the other way:
    a divergence passes only where the alone run's top two logprobs were within tol of each other."""
    params = SamplingParams(max_new_tokens=new, temperature=0, logprobs=2)
    engine = Engine(model, None, max_context=max_context, max_batch=len(prompts), prefix_cache=False)
    together = [o.outputs[0] for o in engine.complete(prompts, params)]
    alone = [engine.complete([p], params)[0].outputs[0] for p in prompts]
    agree, gaps = 0, []
    for x, y in zip(together, alone):
        d = next((i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q), None)
        if d is None:
            agree += 1
        else:
            (_, first), (_, second) = y.top_logprobs[d][:2]
            gaps.append(dict(position=d, top2_gap=first - second))
    return dict(requests=len(prompts), agree=agree, divergences=gaps, ok=all(g["top2_gap"] <= tol for g in gaps))


def bare_graph_step_ms(model, config, prompt: int, new: int, device) -> float:
    from static_decode import CUDAGraphDecoder, StaticCache

    ids = torch.randint(1, config.vocab_size, (1, prompt), device=device)
    with torch.no_grad():
        cache = model.new_cache(1)
        logits = model.lm_head(model.model(ids, cache)[:, -1])
        cache.seen_tokens += prompt
        static = StaticCache.from_hybrid(config, cache, capacity=prompt + new + 8)
        decoder = CUDAGraphDecoder(model, static)
        first = logits.argmax(-1, keepdim=True)
        saved = static.snapshot()
        decoder.greedy(first, 4)
        static.restore(saved)
        synchronize()
        t0 = time.perf_counter()
        decoder.greedy(first, new)
        synchronize()
    return (time.perf_counter() - t0) * 1e3 / new


def prefill_rates(model, config, length: int, device) -> dict:
    """Prefill tokens/s of one prompt through the engine (chunked) and as one plain forward into a HybridCache."""
    prompt = prompts_for(1, length, config.vocab_size, seed=5)[0]
    engine = Engine(model, None, max_context=length + 8, max_batch=1, prefix_cache=False)
    one = SamplingParams(max_new_tokens=1, temperature=0)
    engine.generate_ids([prompt[:600]], one)  # warm-up
    synchronize()
    t0 = time.perf_counter()
    engine.generate_ids([prompt], one)
    synchronize()
    chunked = time.perf_counter() - t0
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        model.lm_head(model.model(ids[:, :600], model.new_cache(1))[:, -1])
        synchronize()
        t0 = time.perf_counter()
        model.lm_head(model.model(ids, model.new_cache(1))[:, -1])
        synchronize()
    whole = time.perf_counter() - t0
    return dict(length=length, engine_tokens_per_s=length / chunked, one_forward_tokens_per_s=length / whole)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64],
                        help="concurrent requests per timed load (none: checks only)")
    parser.add_argument("--check-requests", type=int, default=8)
    parser.add_argument("--check-new", type=int, default=32)
    parser.add_argument("--tol", type=float, default=0.05, help="largest logprob difference graph vs eager (bf16)")
    parser.add_argument("--fp32-tol", type=float, default=1e-3,
                        help="batch-vs-alone-fp32: largest top-two logprob gap at which a divergence passes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (1 is steadiest on a busy machine)")
    parser.add_argument("--no-checks", action="store_true",
                        help="skip the correctness checks (each builds its own engines: with K3_COMPILE_DECODE=1 "
                             "their graphs compile before any timing)")
    parser.add_argument("--checks", nargs="+", default=None, choices=CHECKS,
                        help="run only these checks (default: every one the device and dtype allow)")
    parser.add_argument("--mla-backends", nargs="+", default=None, choices=["torch", "einsum", "auto", "triton"],
                        help="time each concurrency under each K3_MLA_DECODE value (an engine each, one process)")
    parser.add_argument("--out", default=None)
    add_kernels_argument(parser)
    args = parser.parse_args()
    with kernels.use(**args.kernels):
        bench(args, parser)


def bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    config = ModelConfig.from_preset(args.preset)
    with torch.device(device):
        model = K3ForCausalLM(config)
    # Frozen, as the inference CLIs load it: the engine then fuses the projection weights for its CUDA graphs
    # (k3.layers.fused_weights), which it does only for a model nothing trains.
    model = model.to(dtype).eval().requires_grad_(False)
    max_context = args.prompt + args.new + 64
    results: dict = {"bench": "engine", "device": device_name(), "preset": args.preset, "prompt": args.prompt,
                     "new": args.new, "dtype": str(dtype),
                     "compile_decode": kernels.choice("compile_decode"), "kernels": args.kernels}

    check_prompts = prompts_for(args.check_requests, 96, config.vocab_size, seed=1)
    check_prompts = [p[: 17 + 11 * i] for i, p in enumerate(check_prompts)]  # mixed lengths
    checks = {}
    runs = {} if args.no_checks else {
        "batch-vs-alone": lambda: check_batch_vs_alone(model, check_prompts, args.check_new, 512,
                                                       args.tol if device.type == "cuda" else 0.0)}
    if device.type == "cuda" and not args.no_checks:
        runs = {"graph-vs-eager": lambda: check_graph_vs_eager(model, check_prompts, args.check_new, args.tol, 512),
                **runs}
        if dtype != torch.float32:
            runs["batch-vs-alone-fp32"] = lambda: check_batch_vs_alone(
                copy.deepcopy(model).float(), check_prompts, args.check_new, 512, args.fp32_tol)
    if args.checks:
        unavailable = sorted(set(args.checks) - set(runs))
        if unavailable:
            parser.error(f"--checks {unavailable} cannot run here (device {device.type}, dtype {dtype}, "
                         f"--no-checks {args.no_checks}); available: {sorted(runs)}")
        runs = {name: run for name, run in runs.items() if name in args.checks}
    for name, run in runs.items():
        t0 = time.perf_counter()
        checks[name] = dict(run(), seconds=time.perf_counter() - t0)  # first use (compiles) included
        c = checks[name]
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {name}: {c}", flush=True)
        write_json(args.out, {**results, "partial": True, "checks": checks})
    results["checks"] = checks

    params = SamplingParams(max_new_tokens=args.new, temperature=0)
    loads = {}
    for backend, concurrency in itertools.product(args.mla_backends or [None], args.concurrency):
        key = concurrency if backend is None else f"{backend}/{concurrency}"
        # Read when a graph is captured: each engine captures with its own.
        engine = Engine(model, None, max_context=max_context, max_batch=max(concurrency, 1), prefix_cache=False,
                        kernels={"mla_decode": backend} if backend else None)
        if device.type == "cuda":
            print(f"{key}: warm-up (captures the decode graphs, and compiles them with K3_COMPILE_DECODE=1)",
                  flush=True)
        t0 = time.perf_counter()
        run_load(engine, prompts_for(min(concurrency, 2), args.prompt, config.vocab_size, seed=99),
                 SamplingParams(max_new_tokens=8, temperature=0))  # warm-up: graphs, kernels (and compiles)
        warmup_s = time.perf_counter() - t0
        loads[key] = run_load(engine, prompts_for(concurrency, args.prompt, config.vocab_size, seed=2), params)
        loads[key].update(concurrency=concurrency, mla_backend=backend or kernels.choice("mla_decode"),
                          warmup_s=warmup_s, peak_gib=peak_memory_gib())
        print(f"{key}: {loads[key]}", flush=True)
        write_json(args.out, {**results, "partial": True, "loads": loads})
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r["output_tokens_per_s"] for r in loads.values() if r["concurrency"] == 1), None)
    bare = bare_graph_step_ms(model, config, args.prompt, 64, device) if device.type == "cuda" else None
    results["bare_graph_step_ms"] = bare
    results["prefill"] = prefill_rates(model, config, 8192 if device.type == "cuda" else 512, device)
    print(f"prefill: {results['prefill']}", flush=True)
    rows = []
    for key, r in loads.items():
        rows.append([key, r["output_tokens_per_s"], f"{r['output_tokens_per_s'] / base:.1f}x" if base else "",
                     r["ttft_p50_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"], r["tpot_p99_ms"],
                     f"{r['tpot_p50_ms'] / bare:.2f}x" if bare else ""])
    print_table(f"Engine, {args.preset}, {args.prompt} in / {args.new} out, greedy, {dtype}, on {device_name()}"
                + (f"; bare CUDA-graph step {bare:.2f} ms" if bare else ""),
                ["concurrency", "out tok/s", "vs one by one", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                 "TPOT p99 ms", "TPOT / bare step"], rows)
    pool = Engine(model, None, max_context=1 << 20, max_batch=1, prefix_cache=False, num_pages=1).pool
    memory = [dict(context=c, **{k: v / 2**20 for k, v in pool.bytes_per_request(c).items()})
              for c in (1024, 8192, 131072, 1 << 20)]
    print_table("Pool bytes per request (MiB): KDA slot constant, MLA by pages",
                ["context", "KDA MiB", "MLA MiB", "total MiB"],
                [[m["context"], m["kda"], m["mla"], m["total"]] for m in memory])
    write_json(args.out, {**results, "loads": loads, "pool_mib_per_request": memory})


if __name__ == "__main__":
    main()
