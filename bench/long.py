"""One million tokens of context for the `small` preset on one GPU: prefill, then decode; time and memory.

Usage: python bench/long.py [--contexts 131072 1048576] [--chunk 65536] [--new 32] [--out long.json]

The prompt is prefilled in chunks of --chunk tokens (a token budget per forward: the MoE intermediate of one
1M-token forward alone is 12 GiB) into a HybridCache: KDA state and conv tails and the MLA latents carry
across chunks (fla chunk_kda from the carried state; MLA expanded SDPA with the causal diagonal bottom-right,
flash kernel, no mask tensor); logits only for the last position. The cache is then copied into a
StaticCache with room for the new tokens and decoded greedily through a captured CUDA graph. The baseline
row is the same model at 8K context in the same run, so the table shows what a longer context costs per
decode step. Random weights and random token ids.
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from common import device_name, peak_memory_gib, print_table, reset_peak_memory, synchronize, time_ms, write_json

from k3 import K3ForCausalLM, ModelConfig
from static_decode import CUDAGraphDecoder, StaticCache


@torch.no_grad()
def chunked_prefill(model, ids: torch.Tensor, chunk: int):
    """HybridCache prefill in forwards of at most `chunk` tokens; returns (cache, logits of the last position)."""
    cache = model.new_cache(ids.shape[0])
    for start in range(0, ids.shape[1], chunk):
        hidden = model.model(ids[:, start:start + chunk], cache)
        cache.seen_tokens += hidden.shape[1]
    return cache, model.lm_head(hidden[:, -1])


def run_context(model, config, context: int, new: int, chunk: int, device) -> dict:
    reset_peak_memory()
    ids = torch.randint(0, config.vocab_size, (1, context), device=device)
    synchronize()
    t0 = time.perf_counter()
    hybrid, logits = chunked_prefill(model, ids, chunk)
    synchronize()
    prefill_s = time.perf_counter() - t0
    prefill_peak = peak_memory_gib()
    kda_bytes, mla_bytes = hybrid.nbytes("kda"), hybrid.nbytes("mla")
    static = StaticCache.from_hybrid(config, hybrid, capacity=context + new + 8)
    del hybrid
    torch.cuda.empty_cache()
    first = logits.argmax(-1, keepdim=True)
    decoder = CUDAGraphDecoder(model, static)
    saved = static.snapshot()
    tokens = None

    def run():
        nonlocal tokens
        static.restore(saved)
        tokens = decoder.greedy(first, new)

    step_ms = time_ms(run, warmup=1, repeats=3) / new
    return dict(context=context, prefill_s=prefill_s, prefill_tokens_per_s=context / prefill_s,
                prefill_peak_gib=prefill_peak, decode_step_ms=step_ms, decode_tokens_per_s=1e3 / step_ms,
                peak_gib=peak_memory_gib(), kda_cache_mib=kda_bytes / 2**20, mla_cache_mib=mla_bytes / 2**20,
                finite_logits=bool(torch.isfinite(logits).all()), tokens_sample=tokens[0, :8].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1 << 20])
    parser.add_argument("--baseline-context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=65536, help="prefill token budget per forward")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = ModelConfig.from_preset("small")
    with torch.device(device):
        model = K3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    results = []
    for context in (args.baseline_context, *args.contexts):
        try:
            r = run_context(model, config, context, args.new, args.chunk, device)
        except Exception as exc:  # report an out-of-memory or kernel failure instead of dying silently
            traceback.print_exc()
            r = dict(context=context, error=f"{type(exc).__name__}: {exc}"[:300])
        results.append(r)
        print(r, flush=True)
        torch.cuda.empty_cache()
    base = results[0].get("decode_step_ms")
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["context"], "error", r["error"][:60], "", "", "", "", "", ""])
            continue
        rows.append([r["context"], r["prefill_s"], r["prefill_tokens_per_s"], r["prefill_peak_gib"],
                     r["decode_step_ms"], f"{r['decode_step_ms'] / base:.2f}x" if base else "",
                     r["peak_gib"], r["kda_cache_mib"], r["mla_cache_mib"]])
    print_table(f"Long context, `small` preset, batch 1, bf16, prefill chunks of {args.chunk}, on {device_name()}",
                ["context", "prefill s", "prefill tok/s", "prefill peak GiB", "decode ms/step", "vs 8K step",
                 "decode peak GiB", "KDA cache MiB", "MLA cache MiB"], rows)
    write_json(args.out, {"bench": "long", "new_tokens": args.new, "chunk": args.chunk, "results": results})


if __name__ == "__main__":
    main()
