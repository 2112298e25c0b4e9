"""Prefill through the engine against one plain forward of the same tokens, in one run: where a serving step's
prefill time goes, and what prompts of different lengths cost.

Usage: python bench/engine_prefill.py [--preset small] [--rows 8] [--prompt 1024] [--spread 0.12] [--repeats 3]
                                      [--profile DIR] [--out F]

Cases, each --repeats times after one untimed round (fresh random prompts every round; the mixed cases draw
fresh lengths in [prompt * (1 - spread), prompt] every round, as a server's prompts come):
  plain forward     model.model over [rows, prompt] ids, no cache, the last position's logits: the baseline;
  engine, equal     rows prompts of `prompt` tokens through Engine.step until every one is prefilled
                    (max_new_tokens 1), prefix cache off;
  engine, mixed     rows prompts of mixed lengths: chunks from one position share a right-padded forward;
  engine, mixed, apart  the same with prefill_padding=0: one forward per distinct length (the engine before).
  one prompt        one prompt of `prompt` tokens, plain forward [1, prompt] and through the engine (a server's
                    request one by one: its TTFT is this prefill), without and with the prefix cache (which
                    saves the state at the prompt's last page boundary on the way: k3.cache.StateSnapshot);
  first after warm-up  a fresh engine after Engine.warmup() (what `k3 serve` runs before ready), its first three
                    prompts of `prompt` tokens timed one by one: the first against the others is what a fresh
                    server's first request pays beyond the steady state.
Printed: ms per round, prompt tokens/s, and each engine case against the plain forward. With --profile DIR, one
more round of `engine, mixed` and of the plain forward under torch.profiler (CUDA), then one prompt through the
engine and plain, and a fresh engine's first prompt after its warm-up, each with a host-time table: in DIR.
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


def lengths_for(args, generator: torch.Generator, mixed: bool) -> list[int]:
    if not mixed:
        return [args.prompt] * args.rows
    low = max(1, int(args.prompt * (1 - args.spread)))
    return torch.randint(low, args.prompt + 1, (args.rows,), generator=generator).tolist()


def prompts_for(lengths: list[int], vocab: int, generator: torch.Generator) -> list[list[int]]:
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def engine_round(engine: Engine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    synchronize()


@torch.no_grad()
def plain_round(model, prompts: list[list[int]], device) -> None:
    ids = torch.tensor(prompts, device=device)
    hidden = model.model(ids)
    model.lm_head(hidden[:, -1])
    synchronize()


def first_prompts_after_warmup(engine: Engine, args, vocab: int) -> list[float]:
    """ms of each of a warmed-up engine's first three prompts of args.prompt tokens, one at a time."""
    engine.warmup()
    generator = torch.Generator().manual_seed(4)
    times = []
    for _ in range(3):
        prompts = prompts_for([args.prompt], vocab, generator)
        start = time.perf_counter()
        engine_round(engine, prompts)
        times.append(1e3 * (time.perf_counter() - start))
    print(f"first after warm-up: {[round(t, 1) for t in times]} ms", flush=True)
    return times


def run_case(name: str, args, model, device, round_fn, mixed: bool, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    round_fn(prompts_for(lengths_for(args, generator, mixed), vocab, generator))  # untimed: compiles, autotune
    times, tokens = [], 0
    for _ in range(args.repeats):
        prompts = prompts_for(lengths_for(args, generator, mixed), vocab, generator)
        start = time.perf_counter()
        round_fn(prompts)
        times.append(time.perf_counter() - start)
        tokens += sum(len(p) for p in prompts)
    ms = 1e3 * sum(times) / len(times)
    result = {"ms_per_round": ms, "ms_min": 1e3 * min(times), "tokens_per_s": tokens / sum(times)}
    print(f"{name}: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--spread", type=float, default=0.12, help="mixed lengths: down to prompt * (1 - spread)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", default=None, help="a folder for the profiles (CUDA)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = K3ForCausalLM(ModelConfig.from_preset(args.preset))
    model = model.to(dtype).eval()

    def engine(padding: float, max_context: int | None = None, prefix_cache: bool = False) -> Engine:
        return Engine(model, None, max_context=max_context or args.prompt + 64, max_batch=args.rows,
                      prefix_cache=prefix_cache, prefill_padding=padding)

    # A fresh engine sized as bench/serve.py's server (--max-context 2048): its warm-up's lengths are the server's.
    served_context = max(2048, args.prompt + 64)

    equal, mixed, apart = engine(0.25), engine(0.25), engine(0.0)
    cases = {
        "plain forward": run_case("plain forward", args, model, device, lambda p: plain_round(model, p, device),
                                  False, 1),
        "engine, equal": run_case("engine, equal", args, model, device, lambda p: engine_round(equal, p), False, 1),
        "engine, mixed": run_case("engine, mixed", args, model, device, lambda p: engine_round(mixed, p), True, 2),
        "engine, mixed, apart": run_case("engine, mixed, apart", args, model, device,
                                         lambda p: engine_round(apart, p), True, 2),
    }
    one = argparse.Namespace(**{**vars(args), "rows": 1})
    single = engine(0.25)
    cases["plain forward, one prompt"] = run_case("plain forward, one prompt", one, model, device,
                                                  lambda p: plain_round(model, p, device), False, 3)
    cases["engine, one prompt"] = run_case("engine, one prompt", one, model, device,
                                           lambda p: engine_round(single, p), False, 3)
    cached = engine(0.25, prefix_cache=True)
    cases["engine, one prompt, prefix cache"] = run_case("engine, one prompt, prefix cache", one, model, device,
                                                         lambda p: engine_round(cached, p), False, 3)
    firsts = first_prompts_after_warmup(engine(0.25, served_context), args, model.config.vocab_size)
    base = cases["plain forward"]["tokens_per_s"]
    base_one = cases["plain forward, one prompt"]["tokens_per_s"]
    rows = [[name, f"{r['ms_per_round']:.1f}", f"{r['ms_min']:.1f}", f"{r['tokens_per_s']:,.0f}",
             f"{r['tokens_per_s'] / (base_one if 'one prompt' in name else base):.2f}x"] for name, r in cases.items()]
    rows.append(["first after warm-up", " / ".join(f"{ms:.1f}" for ms in firsts), "", "",
                 f"first {firsts[0] / min(firsts[1:]):.2f}x the next"])
    title = f"Prefill of {args.rows} prompts of <= {args.prompt} tokens, {args.preset}, {dtype}, on {device_name()}"
    print_table(title, ["", "ms a round", "min ms", "prompt tok/s", "vs plain forward"], rows)
    if args.profile and device.type == "cuda":
        from train import profile_step

        folder = Path(args.profile)
        folder.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(3)
        prompts = prompts_for(lengths_for(args, generator, True), model.config.vocab_size, generator)
        profile_step(lambda: engine_round(mixed, prompts), str(folder / "engine_mixed.txt"),
                     f"engine prefill, {args.rows} prompts of mixed lengths <= {args.prompt}, {args.preset}")
        profile_step(lambda: plain_round(model, [p[:min(map(len, prompts))] for p in prompts], device),
                     str(folder / "plain_forward.txt"), f"plain forward, {args.rows} rows, {args.preset}")
        prompt = prompts[:1]
        profile_step(lambda: engine_round(single, prompt), str(folder / "engine_one.txt"),
                     f"engine prefill, one prompt of {len(prompt[0])} tokens, {args.preset}", cpu_table=True)
        profile_step(lambda: plain_round(model, prompt, device), str(folder / "plain_one.txt"),
                     f"plain forward, one prompt of {len(prompt[0])} tokens, {args.preset}", cpu_table=True)
        fresh = engine(0.25, served_context)
        fresh.warmup()
        profile_step(lambda: engine_round(fresh, [list(reversed(prompt[0]))]), str(folder / "engine_first.txt"),
                     f"a fresh engine's first prompt after its warm-up, {len(prompt[0])} tokens, {args.preset}",
                     cpu_table=True)
    write_json(args.out, {"bench": "engine_prefill", "device_name": device_name(), "preset": args.preset,
                          "rows": args.rows, "prompt": args.prompt, "spread": args.spread, "repeats": args.repeats,
                          "dtype": str(dtype), "cases": cases, "first_after_warmup_ms": firsts})


if __name__ == "__main__":
    main()
