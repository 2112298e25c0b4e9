"""Decode speed on one GPU: k3 (static cache + CUDA graph) against transformers' `generate`, in one run.

Usage: python bench/decode.py [--cases 1x8192 1x131072 64x8192 64x131072] [--new 32] [--compile] [--out decode.json]

For each case (batch x prompt length):
  k3     prefill into a HybridCache (flash SDPA for MLA, fla chunk_kda), copy into a StaticCache, capture one
         decode step as a CUDA graph, then time `--new` greedy steps (sampling stays on the device).
         Also timed: the same step run eagerly (no graph). With --compile, also the step compiled by
         torch.compile (inductor, one graph) and captured: its ms/step next to the uncompiled graph's, the
         wall time of its first use (the compile), its first step's logits against the eager step's (max
         |difference|, ||difference|| / ||eager||, argmax agreement; bf16 kernels fused in fp32 round
         differently), and (CUDA) the kernels each captured graph launches. Prompts of more than
         --max-real-tokens tokens in total (batch x prompt) are not prefilled: the static cache is filled with
         random contents at that position instead, which costs the decode step the same (it reads the whole
         cache either way).
  peer   transformers KimiLinearForCausalLM.generate (greedy, sdpa, grouped_mm experts) at the matched peer
         config: ms per step = (time for 1 + new tokens - time for 1 token) / new.
Models: k3-small (the `small` preset) and k3-matched (k3 at the peer's config), random weights.
Also printed: the memory floor of each k3 step (the bytes it must move: dense weights, the routed experts the
batch's tokens touch, KDA states read + written, MLA latents read; over the copy bandwidth measured in the
same run) and the graph step's ratio to it; cache bytes per sequence against context length.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from unittest import mock

import torch

from common import (device_name, peak_memory_gib, print_table, relative_error, reset_peak_memory, synchronize, time_ms,
                    write_json, write_kernel_sources)
from long import chunked_prefill
from train import k3_matched_config, peer_model

from k3 import K3ForCausalLM, ModelConfig
from static_decode import CUDAGraphDecoder, StaticCache, compiled_decode_step, decode_step
from k3.layers.fused_weights import fuse_model_weights, unfuse_model_weights
import k3.layers.moe as moe_layers


# Tokens per prefill forward (batch x chunk length). 64 x 8K in one forward ran out of memory on an 80 GB H100
# (the MoE intermediate of 524K tokens); in chunks the cache carries KDA states and MLA latents across them.
PREFILL_TOKEN_BUDGET = 65536


def prefill(model, ids: torch.Tensor):
    """HybridCache prefill without materialising logits for every position: returns (cache, last logits)."""
    return chunked_prefill(model, ids, max(1, PREFILL_TOKEN_BUDGET // ids.shape[0]))


def synthetic_static(config: ModelConfig, batch: int, filled: int, capacity: int, device) -> StaticCache:
    """A static cache whose first `filled` positions hold random contents (for timing only)."""
    cache = StaticCache(config, batch, capacity, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for slot in cache.layers:
        for buffer in slot.buffers():
            buffer.copy_(torch.randn(buffer.shape, generator=gen, device=device, dtype=buffer.dtype) * 0.1)
    cache.position.fill_(filled)
    return cache


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth in bytes/s, measured as a large device-to-device copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, repeats=10)
    return 2 * nbytes / (ms / 1e3)


def step_bytes(model, config, static, first, batch: int, context: int) -> dict:
    """Bytes one decode step must move at least: every weight it uses once (the routed experts only where the
    batch's tokens go, counted from one recorded step; the embedding only the looked-up rows), the KDA states
    and conv tails read and written, and the MLA latents of the context read."""
    from k3.rl.routing import RoutingReplay

    saved = static.snapshot()
    replay = RoutingReplay(model)
    with replay.record() as routes:
        decode_step(model, static, first)
    static.restore(saved)
    touched = [int(torch.unique(calls[0]).numel()) for calls in routes]  # distinct experts per MoE layer
    moes = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    layer_bytes = [sum(p.numel() * p.element_size() for p in (m.w1, m.w2, m.w3)) for m in moes]
    expert_weights = sum(layer_bytes)
    expert_bytes = sum(b // config.num_experts * n for b, n in zip(layer_bytes, touched))
    embed = model.model.embed_tokens.weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) - expert_weights - \
        embed.numel() * embed.element_size() + batch * embed.shape[1] * embed.element_size()
    kda = sum(t.numel() * t.element_size() for slot in static.layers if hasattr(slot, "conv_tails")
              for t in [slot.state, *slot.conv_tails])
    mla = batch * context * (config.kv_lora_rank + config.qk_rope_head_dim) * 2 * config.layer_types.count("mla")
    return dict(dense_weight_bytes=dense, expert_bytes=expert_bytes, experts_touched_mean=sum(touched) / len(touched),
                kda_state_bytes=2 * kda, mla_cache_bytes=mla, total_bytes=dense + expert_bytes + 2 * kda + mla)


# --moe-backends names: the routed experts' path (K3_MOE_BACKEND), the router's (K3_ROUTER_BACKEND), the dense
# projections' (K3_LINEAR_BACKEND), MLA's absorbed attention (K3_MLA_DECODE) and the norms (K3_FUSED_BACKEND: fla's
# kernel as an opaque op, or auto: the PyTorch twin that Inductor fuses), each variant adding one change. Up to
# "mla" the router's logits are a matmul in the compiled step too; "logits" takes the compiled reduction for few
# tokens (k3.layers.moe.COMPILED_LOGITS_MAX_TOKENS), as k3 does by default.
_BEFORE = {"K3_MOE_BACKEND": "triton", "K3_ROUTER_BACKEND": "triton", "K3_LINEAR_BACKEND": "auto",
           "K3_MLA_DECODE": "einsum", "K3_FUSED_BACKEND": "fla", "K3_MOE_PAIR_LISTS": "0",
           "K3_KDA_RECURRENT_LAUNCH": "fla", "K3_CONV_STEP_BACKEND": "torch", "K3_MOE_COMBINE": "bmm"}
# K3_MOE_COMBINE=bmm: the compiled step's combine before "combine_sum" (the uncompiled graphs' combine was Triton's
# kernel under auto until then; with bmm their rows run cuBLAS's batched matmul in its place).
MOE_VARIANTS = {
    "grouped": dict(_BEFORE, K3_MOE_BACKEND="grouped", K3_ROUTER_BACKEND="torch", K3_LINEAR_BACKEND="torch"),
    "triton": dict(_BEFORE, K3_ROUTER_BACKEND="torch", K3_LINEAR_BACKEND="torch"),
    "routed": dict(_BEFORE, K3_LINEAR_BACKEND="torch"),
    "skinny": dict(_BEFORE),
    "mla": dict(_BEFORE, K3_MLA_DECODE="auto"),
    "norms": dict(_BEFORE, K3_FUSED_BACKEND="auto"),
    "logits": dict(_BEFORE, K3_FUSED_BACKEND="auto"),
    "logits_mla": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto"),
    "combo": dict(_BEFORE, K3_FUSED_BACKEND="auto"),
    # logits_mla with every dense projection of up to k3.ops.linear_triton.SKINNY_MAX_ROWS rows on the skinny
    # kernel (auto keeps cuBLAS past SKINNY_AUTO_MAX_ROWS rows)
    "skinny_rows": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_LINEAR_BACKEND="triton"),
    # logits_mla with the pair-order expert kernels sharing each expert's pair list (k3.ops.moe_triton)
    "pair_lists": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_MOE_PAIR_LISTS="1"),
    # logits_mla with fla's recurrent KDA kernel launched by k3 with a tile fitted to the batch
    # (k3/ops/kda/fla_launch.py), then with the shared pair lists as well
    "kda_launch": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_KDA_RECURRENT_LAUNCH="auto"),
    "kda_pairs": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_KDA_RECURRENT_LAUNCH="auto",
                      K3_MOE_PAIR_LISTS="1"),
    # kda_launch with the short convs' decode step as one kernel that slides the window in place
    # (k3/ops/conv_step_triton.py)
    "conv_step": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_KDA_RECURRENT_LAUNCH="auto",
                      K3_CONV_STEP_BACKEND="auto"),
    # conv_step with the MoE combine as products and additions over K for Inductor to fuse, instead of the bmm that
    # stays a cuBLAS batched gemv (k3.ops.moe_combine.combine_pairs_sum): k3's defaults (auto)
    "combine_sum": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_KDA_RECURRENT_LAUNCH="auto",
                        K3_CONV_STEP_BACKEND="auto", K3_MOE_COMBINE="auto"),
    # conv_step and combine_sum compiled without Inductor's padding of wide row strides (INDUCTOR_CONFIG below)
    "no_padding": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_KDA_RECURRENT_LAUNCH="auto",
                       K3_CONV_STEP_BACKEND="auto"),
    "sum_no_padding": dict(_BEFORE, K3_FUSED_BACKEND="auto", K3_MLA_DECODE="auto", K3_KDA_RECURRENT_LAUNCH="auto",
                           K3_CONV_STEP_BACKEND="auto", K3_MOE_COMBINE="auto"),
}
# "combo" also turns on Inductor's horizontal fusion of independent kernels (torch._inductor.config.combo_kernels,
# off in k3 and by default) while its graph compiles: the step's 72 conv-window copies at batch 1 (about 1 us
# each) are independent kernels of equal shape.
# "no_padding" and "sum_no_padding" turn off Inductor's padding of row strides to 128 bytes (comprehensive_padding,
# on for GPUs by default), under which a padded GEMM output reached an op that takes the traced strides through a copy
# (measured: no change once k3's strided-input ops were tagged to take any layout, BENCHMARKS.md round thirteen).
INDUCTOR_CONFIG = {"combo": {"combo_kernels": True}, "no_padding": {"comprehensive_padding": False},
                   "sum_no_padding": {"comprehensive_padding": False}}
DEFAULT_LOGITS_MAX_TOKENS = moe_layers.COMPILED_LOGITS_MAX_TOKENS
LOGITS_MAX_TOKENS = {name: DEFAULT_LOGITS_MAX_TOKENS
                     for name in ("logits", "logits_mla", "combo", "skinny_rows", "pair_lists", "kda_launch",
                                  "kda_pairs", "conv_step", "combine_sum", "no_padding", "sum_no_padding")}  # else 0


def bench_k3(model, config, batch: int, prompt: int, new: int, max_real: int, device,
             bandwidth: float | None = None, compile: bool = False, profile_dir: str | None = None,
             label: str = "k3", fuse: bool = False, moe_backends: list[str] | None = None,
             progress=None) -> dict:
    """progress(result so far), if given, after each variant (the caller writes a partial JSON: a run stopped in
    a later variant's compile keeps the earlier ones)."""
    import torch._inductor.config  # noqa: F401  (torch._inductor.config.patch below)

    reset_peak_memory()
    ids = torch.randint(0, config.vocab_size, (batch, prompt), device=device)
    synchronize()
    t0 = time.perf_counter()
    if batch * prompt <= max_real:
        hybrid, logits = prefill(model, ids)
        synchronize()
        prefill_s = time.perf_counter() - t0
        static = StaticCache.from_hybrid(config, hybrid, capacity=prompt + new + 8)
        per_seq = {"kda": hybrid.nbytes("kda") / batch, "mla": hybrid.nbytes("mla") / batch}
        del hybrid
        first = logits.argmax(-1, keepdim=True)
        synthetic = False
    else:
        static = synthetic_static(config, batch, prompt, prompt + new + 8, device)
        prefill_s = float("nan")
        per_seq = None
        first = ids[:, -1:]
        synthetic = True
    floor = step_bytes(model, config, static, first, batch, prompt) if bandwidth else {}
    saved = static.snapshot()
    eager_ms = time_ms(lambda: (static.restore(saved), decode_step(model, static, first)), warmup=2, repeats=5)
    static.restore(saved)
    with torch.no_grad():
        eager_logits = decode_step(model, static, first).float()
    static.restore(saved)
    result = dict(prefill_s=prefill_s, eager_step_ms=eager_ms)
    # Each variant with separate projection weights, then with them fused into one buffer per group (what the
    # engine runs for frozen models: k3.layers.fused_weights); the model is left unfused for the next case.
    # With --moe-backends (an A/B of the fused step) the unfused step is not compiled: each compile is a minute.
    compile_unfused = compile and not moe_backends
    variants = [("graph", False, False, None)] + ([("compiled_graph", True, False, None)] if compile_unfused else [])
    if fuse:
        # With --moe-backends, the fused variants once per routed-expert path (K3_MOE_BACKEND), named
        # fused_graph_<backend>: an A/B of the expert kernels inside the same decode step and process.
        for backend in moe_backends or [None]:
            suffix = f"_{backend}" if backend else ""
            variants += [(f"fused_graph{suffix}", False, True, backend)]
            variants += [(f"fused_compiled_graph{suffix}", True, True, backend)] if compile else []
    with mock.patch.dict(os.environ), mock.patch.object(moe_layers, "COMPILED_LOGITS_MAX_TOKENS"):
        for name, compiled, fused, backend in variants:
            if fused:
                fuse_model_weights(model)
            if backend:
                os.environ.update(MOE_VARIANTS[backend])
                moe_layers.COMPILED_LOGITS_MAX_TOKENS = LOGITS_MAX_TOKENS.get(backend, 0)
                torch._dynamo.reset()  # the backend is read while tracing: a graph compiled for another must go
            path = f"{profile_dir}/{label}_{batch}x{prompt}_{name}.txt" if profile_dir else None
            inductor = INDUCTOR_CONFIG.get(backend, {}) if compiled else {}
            try:
                with torch._inductor.config.patch(inductor):
                    result.update(time_greedy(model, static, first, new, compiled, eager_logits, name, path))
            except Exception as exc:  # one variant failing (a compile error) leaves the others to run
                traceback.print_exc()
                result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            static.restore(saved)
            if progress:
                progress(result)
    unfuse_model_weights(model)
    graph_ms = result["graph_step_ms"]
    if floor:
        floor["floor_ms"] = floor["total_bytes"] / bandwidth * 1e3
        floor["graph_vs_floor"] = graph_ms / floor["floor_ms"]
        for key in [k for k in result if k.endswith("_step_ms") and k not in ("graph_step_ms", "eager_step_ms")]:
            floor[f"{key[:-len('_step_ms')]}_vs_floor"] = result[key] / floor["floor_ms"]
    return dict(result, memory_floor=floor, tokens_per_s=batch * 1e3 / graph_ms, synthetic_cache=synthetic,
                cache_bytes_per_seq=per_seq, peak_gib=peak_memory_gib())


def time_greedy(model, static: StaticCache, first: torch.Tensor, new: int, compiled: bool,
                eager_logits: torch.Tensor, name: str, profile_path: str | None = None) -> dict:
    """ms per greedy step of the captured decode step (compiled or not; off CUDA the same loop without graphs),
    the first use's wall time, the first step's max |logit difference| to the eager step, and the kernels one
    replay launches (CUDA). `static` must hold the state `first` continues from; it is left advanced."""
    saved = static.snapshot()
    start = time.perf_counter()
    if static.position.is_cuda:
        decoder = CUDAGraphDecoder(model, static, compile=compiled)
        first_use_s = time.perf_counter() - start
        logits = decoder.step(first).float()
        static.restore(saved)
        kernels = graph_kernel_count(lambda: decoder.step(first), profile_path)
        if profile_path:
            static.restore(saved)
            write_kernel_sources(lambda: decoder.step_fn(model, static, first), profile_path[:-4] + "_sources.txt")
        greedy = decoder.greedy
    else:  # no graphs off CUDA: the same greedy loop, eagerly
        step = compiled_decode_step() if compiled else decode_step
        logits = step(model, static, first).float()
        first_use_s = time.perf_counter() - start
        kernels = None

        @torch.no_grad()
        def greedy(ids, n):
            for _ in range(n):
                ids = step(model, static, ids).argmax(-1, keepdim=True)
    static.restore(saved)

    def run():
        static.restore(saved)
        greedy(first, new)

    step_ms = time_ms(run, warmup=1, repeats=3) / new
    out = {f"{name}_step_ms": step_ms, f"{name}_first_use_s": first_use_s,
           f"{name}_vs_eager_max_abs_diff": (logits - eager_logits).abs().max().item(),
           f"{name}_vs_eager_rel_err": relative_error(logits, eager_logits),
           f"{name}_vs_eager_argmax_agree": (logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item(),
           f"{name}_kernels": kernels}
    print(f"  {name}: {step_ms:.3f} ms/step, first use {first_use_s:.1f} s, max |logits - eager| "
          f"{out[f'{name}_vs_eager_max_abs_diff']:.3g} (max |eager| {eager_logits.abs().max().item():.3g}, "
          f"||d|| / ||eager|| {out[f'{name}_vs_eager_rel_err']:.3g}), kernels per replay {kernels}", flush=True)
    return out


def graph_kernel_count(replay, profile_path: str | None = None) -> int | None:
    """GPU kernels launched by one call of `replay` (a CUDA-graph replay), counted by the profiler; memcpy and
    memset nodes are not kernels. None when the profiler records no device activity. With `profile_path`, also
    writes the replay's kernel table there (by total CUDA time, with call counts)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        replay()
        synchronize()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not device:
        return None
    if profile_path:
        write_kernel_table(device, profile_path)
    return sum(1 for e in device if not e.name.lower().startswith(("memcpy", "memset")))


def write_kernel_table(events, path: str) -> None:
    """Kernels of one replay grouped by name: launches, total and mean microseconds, share of the replay."""
    from k3.atomic import atomic_write_bytes

    groups: dict[str, list[float]] = {}
    for e in events:
        groups.setdefault(e.name, []).append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    total = sum(sum(v) for v in groups.values())
    lines = [f"{len(events)} device events, {total:.1f} us of kernel time in one replay",
             f"{'launches':>8} {'total us':>10} {'mean us':>8} {'share':>6}  kernel"]
    for name, times in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{len(times):8d} {sum(times):10.1f} {sum(times) / len(times):8.2f} "
                     f"{sum(times) / max(total, 1e-9):6.1%}  {name[:140]}")
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    print(f"  kernel table of one replay: {path}", flush=True)


@torch.no_grad()
def bench_peer(model, batch: int, prompt: int, new: int, device) -> dict:
    reset_peak_memory()
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=device)
    mask = torch.ones_like(ids)

    def generate(n: int):
        return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)

    one = time_ms(generate(1), warmup=1, repeats=2)
    many = time_ms(generate(1 + new), warmup=0, repeats=2)
    step_ms = (many - one) / new
    return dict(prefill_s=one / 1e3, graph_step_ms=step_ms, tokens_per_s=batch * 1e3 / step_ms,
                peak_gib=peak_memory_gib())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["1x8192", "1x131072", "64x8192", "64x131072"])
    parser.add_argument("--peer-cases", nargs="+", default=["1x8192", "1x131072", "64x8192"])
    parser.add_argument("--models", nargs="+", default=["k3-small", "k3-matched", "peer"])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--max-real-tokens", type=int, default=1 << 20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true",
                        help="also time the decode step compiled by torch.compile (one graph) and captured")
    parser.add_argument("--fuse", action="store_true",
                        help="also time each graph with the projection weights fused (k3.layers.fused_weights)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write each captured graph's kernel table (one replay) into DIR")
    parser.add_argument("--moe-backends", nargs="+", default=None, choices=list(MOE_VARIANTS),
                        help="with --fuse: time the fused variants once per path (MOE_VARIANTS: grouped, triton "
                             "experts, + fused router, + skinny projections, + MLA kernel; skinny + Inductor's "
                             "norms, + compiled router logits, + MLA kernel; logits + Inductor's combo kernels); "
                             "the unfused step is then not compiled")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if args.compile:
        # Every model x case (batch, cache capacity) compiles its own static-shape graph of decode_step; past
        # dynamo's default limit of 8 per function it would quietly run the rest eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    if bandwidth:
        print(f"device copy bandwidth (read + write, 1 GiB): {bandwidth / 1e12:.2f} TB/s", flush=True)
    results: dict[str, dict[str, dict]] = {}
    for name in args.models:
        torch.manual_seed(0)
        results[name] = {}
        if name == "peer":
            model = peer_model(device).eval()
            cases = args.peer_cases
        else:
            config = k3_matched_config() if name == "k3-matched" else ModelConfig.from_preset("small")
            with torch.device(device):
                model = K3ForCausalLM(config)
            model = model.to(torch.bfloat16).eval()
            cases = args.cases
        for case in cases:
            batch, prompt = (int(v) for v in case.lower().split("x"))
            try:
                if name == "peer":
                    r = bench_peer(model, batch, prompt, args.new, device)
                else:
                    def partial(so_far, name=name, case=case):
                        write_json(args.out, {"bench": "decode", "partial": True,
                                              "results": {**results, name: {**results[name], case: so_far}}})

                    r = bench_k3(model, config, batch, prompt, args.new, args.max_real_tokens, device, bandwidth,
                                 compile=args.compile, profile_dir=args.profile, label=name,
                                 fuse=args.fuse, moe_backends=args.moe_backends, progress=partial)
            except Exception as exc:
                traceback.print_exc()
                r = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            results[name][case] = r
            print(name, case, r, flush=True)
            write_json(args.out, {"bench": "decode", "partial": True, "results": results})
            torch.cuda.empty_cache()
        model = None
        torch.cuda.empty_cache()

    rows = []
    for name, cases in results.items():
        for case, r in cases.items():
            if "error" in r:
                rows.append([name, case, "error", r["error"][:50], "", "", "", "", ""])
                continue
            peer = results.get("peer", {}).get(case, {})
            ratio = (f"{peer['graph_step_ms'] / r['graph_step_ms']:.1f}x"
                     if "graph_step_ms" in peer and name != "peer" else "")
            rows.append([name, case + (" (synthetic cache)" if r.get("synthetic_cache") else ""), r["prefill_s"],
                         r.get("eager_step_ms", float("nan")), r["graph_step_ms"], r["tokens_per_s"], ratio,
                         r["peak_gib"]])
    print_table(f"Decode, greedy, {args.new} new tokens, bf16, on {device_name()}",
                ["model", "batch x prompt", "prefill s", "eager ms/step", "graph ms/step", "tokens/s",
                 "speed-up vs peer", "peak GiB"], rows)
    if args.compile:
        compile_rows = [[name, case, r["eager_step_ms"], r["graph_step_ms"], r["compiled_graph_step_ms"],
                         f"{r['graph_step_ms'] / r['compiled_graph_step_ms']:.2f}x", r["compiled_graph_first_use_s"],
                         r["graph_kernels"], r["compiled_graph_kernels"], r["graph_vs_eager_max_abs_diff"],
                         r["compiled_graph_vs_eager_max_abs_diff"], r["compiled_graph_vs_eager_rel_err"]]
                        for name, cases in results.items() if name != "peer"
                        for case, r in cases.items() if "compiled_graph_step_ms" in r]
        print_table("Decode step compiled by torch.compile (one graph) and captured, against the uncompiled graph",
                    ["model", "batch x prompt", "eager ms", "graph ms", "compiled graph ms", "speed-up",
                     "compile s (first use)", "kernels (graph)", "kernels (compiled)", "graph max|dlogit|",
                     "compiled max|dlogit|", "compiled rel err"], compile_rows)

    variant_rows = []
    for name, cases in results.items():
        for case, r in cases.items():
            floor_ms = (r.get("memory_floor") or {}).get("floor_ms")
            for variant in [k[:-len("_step_ms")] for k in r if k.endswith("_step_ms") and k != "eager_step_ms"]:
                ms = r[f"{variant}_step_ms"]
                variant_rows.append([name, case, variant, ms, f"{r['graph_step_ms'] / ms:.2f}x",
                                     r.get(f"{variant}_kernels"), f"{ms / floor_ms:.2f}x" if floor_ms else "",
                                     r.get(f"{variant}_vs_eager_rel_err"), r.get(f"{variant}_first_use_s")])
    if args.fuse or args.compile:
        print_table("Every captured variant of the decode step",
                    ["model", "batch x prompt", "variant", "ms/step", "vs graph", "kernels", "vs floor",
                     "rel err vs eager", "first use s"], variant_rows)

    floor_rows = []
    for name, cases in results.items():
        for case, r in cases.items():
            f = r.get("memory_floor") or {}
            if f:
                floor_rows.append([name, case, f["dense_weight_bytes"] / 2**20, f["experts_touched_mean"],
                                   f["expert_bytes"] / 2**20, (f["kda_state_bytes"] + f["mla_cache_bytes"]) / 2**20,
                                   f["floor_ms"], r["graph_step_ms"], f"{f['graph_vs_floor']:.2f}x"])
    if floor_rows:
        print_table(f"Decode memory floor: bytes a step must read / copy bandwidth {bandwidth / 1e12:.2f} TB/s",
                    ["model", "batch x prompt", "dense MiB", "experts touched/layer", "experts MiB", "cache MiB",
                     "floor ms", "graph ms", "graph / floor"], floor_rows)

    mem_rows = []
    for name in ("k3-small", "k3-matched"):
        config = k3_matched_config() if name == "k3-matched" else ModelConfig.from_preset("small")
        kda = next((r["cache_bytes_per_seq"]["kda"] for r in results.get(name, {}).values()
                    if r.get("cache_bytes_per_seq")), None)
        per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * 2 * config.layer_types.count("mla")
        for context in (8192, 131072, 1 << 20):
            measured = [r["cache_bytes_per_seq"] for c, r in results.get(name, {}).items()
                        if r.get("cache_bytes_per_seq") and int(c.split("x")[1]) == context]
            mla = measured[0]["mla"] if measured else per_token * context
            mem_rows.append([name, context, (kda or 0) / 2**20, mla / 2**20, ((kda or 0) + mla) / 2**20,
                             "measured" if measured else "bytes/token x context"])
    print_table("Decode cache per sequence (MiB): KDA state is constant, MLA latent grows with context",
                ["model", "context", "KDA MiB", "MLA MiB", "total MiB", "source"], mem_rows)
    write_json(args.out, {"bench": "decode", "new_tokens": args.new, "results": results, "bandwidth": bandwidth,
                          "cache_per_sequence": [dict(zip(["model", "context", "kda_mib", "mla_mib", "total_mib",
                                                           "source"], r)) for r in mem_rows]})


if __name__ == "__main__":
    main()
