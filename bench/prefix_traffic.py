"""Chat-like traffic through the engine with and without the prefix cache, in one run: rounds of prompts that
share a system prompt and differ after it, more prompts a round than the cache has entries (each prompt's own
entry competes with the shared one).

Usage: python bench/prefix_traffic.py [--preset debug] [--system 70] [--rounds 4] [--prompts 32] [--batch 16]
                                      [--new 14] [--out F]

Printed per engine: seconds a round (after the first, which fills the cache), prefix-cache hits and the prompt
tokens they skipped, prefill forwards, and the cached engine's time against the uncached one's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import device_name, print_table, synchronize, write_json  # noqa: E402

from k3 import K3ForCausalLM, ModelConfig  # noqa: E402
from k3.infer import Engine, SamplingParams  # noqa: E402


def traffic(args, vocab: int) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(1, vocab, (args.system,), generator=generator).tolist()
    lengths = torch.randint(20, 120, (args.rounds, args.prompts), generator=generator)
    return [[system + torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in row]
            for row in lengths]


def run(model, rounds, args, prefix_cache: bool) -> dict:
    engine = Engine(model, None, max_context=1024, max_batch=args.batch, prefix_cache=prefix_cache)
    engine.warmup()
    forwards = [0]
    real = engine.runner.prefill

    def counted(*a):
        forwards[0] += 1
        return real(*a)

    engine.runner.prefill = counted
    seconds = []
    for prompts in rounds:
        start = time.perf_counter()
        engine.generate_ids(prompts, SamplingParams(max_new_tokens=args.new, temperature=0.0))
        synchronize()
        seconds.append(time.perf_counter() - start)
    stats = engine.stats()
    result = {"seconds_a_round": seconds, "steady_s": sum(seconds[1:]) / max(1, len(seconds) - 1),
              "hits": stats["prefix_cache_hits"], "hit_tokens": stats["prefix_cache_hit_tokens"],
              "prompt_tokens": stats["prompt_tokens"], "prefill_forwards": forwards[0]}
    print(f"prefix cache {'on' if prefix_cache else 'off'}: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--system", type=int, default=70)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new", type=int, default=14)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        model = K3ForCausalLM(ModelConfig.from_preset(args.preset))
    model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    rounds = traffic(args, model.config.vocab_size)
    off, on = run(model, rounds, args, False), run(model, rounds, args, True)
    rows = [[name, f"{r['steady_s'] * 1e3:.0f}", str(r["hits"]), f"{r['hit_tokens']:,}", f"{r['prompt_tokens']:,}",
             str(r["prefill_forwards"])] for name, r in (("no prefix cache", off), ("prefix cache", on))]
    print_table(f"{args.rounds} rounds of {args.prompts} prompts sharing a {args.system}-token system prompt, "
                f"batch {args.batch}, {args.preset} on {device_name()}",
                ["", "ms a round (after the first)", "hits", "tokens skipped", "prompt tokens run", "prefill forwards"],
                rows)
    print(f"prefix cache against none: {off['steady_s'] / on['steady_s']:.2f}x", flush=True)
    write_json(args.out, {"bench": "prefix_traffic", "device_name": device_name(), "preset": args.preset,
                          "args": vars(args), "off": off, "on": on})


if __name__ == "__main__":
    main()
