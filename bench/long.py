"""One million tokens of context for the `small` preset on one GPU: prefill, then decode; time and memory.

Usage: python bench/long.py [--context 1048576] [--new 32] [--out long.json]

The prompt is prefilled in one forward into a HybridCache (fla chunk_kda for KDA, flash SDPA for MLA, logits
only for the last position), copied into a StaticCache with room for the new tokens, and decoded greedily
through a captured CUDA graph. The baseline row is the same model at 8K context in the same run, so the
table shows what the 128x longer context costs per decode step. Random weights and random token ids.
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from common import device_name, peak_memory_gib, print_table, reset_peak_memory, synchronize, time_ms, write_json
from decode import prefill

from k3 import K3ForCausalLM, ModelConfig
from k3.infer.cuda_graph import CUDAGraphDecoder
from k3.infer.static_cache import StaticCache


def run_context(model, config, context: int, new: int, device) -> dict:
    reset_peak_memory()
    ids = torch.randint(0, config.vocab_size, (1, context), device=device)
    synchronize()
    t0 = time.perf_counter()
    hybrid, logits = prefill(model, ids)
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
    parser.add_argument("--context", type=int, default=1 << 20)
    parser.add_argument("--baseline-context", type=int, default=8192)
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
    for context in (args.baseline_context, args.context):
        try:
            r = run_context(model, config, context, args.new, device)
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
    print_table(f"Long context, `small` preset, batch 1, bf16, on {device_name()}",
                ["context", "prefill s", "prefill tok/s", "prefill peak GiB", "decode ms/step", "vs 8K step",
                 "decode peak GiB", "KDA cache MiB", "MLA cache MiB"], rows)
    write_json(args.out, {"bench": "long", "new_tokens": args.new, "results": results})


if __name__ == "__main__":
    main()
