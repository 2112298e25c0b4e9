"""On-policy distillation throughput on one GPU: student sampling and teacher scoring, both on k3's engine.

Usage: python bench/distill.py [--preset small] [--prompts 16] [--group 4] [--prompt-len 256] [--new 256]
                               [--out distill.json]

What `k3 distill --mode on-policy` does per step, at `small` scale with random weights: the student samples
`--group` completions of each prompt through Engine.complete (n forks of one prefill, sampled-token logprobs,
CUDA-graph decode in bf16), then the teacher scores every sampled token with Engine.score (packed prefill,
log p of the given tokens). Printed: sampled tokens/s and scored tokens/s, each after one untimed warm-up
round (graph capture, kernel autotune), and as the baseline in the same run the bare CUDA-graph decode step of
the same student at the same batch (bench/decode.py's path), so the sampling row says what the engine costs.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import device_name, print_table, synchronize, write_json

from k3 import K3ForCausalLM, ModelConfig
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams


def build(preset: str, seed: int, device) -> K3ForCausalLM:
    torch.manual_seed(seed)
    with torch.device(device):
        model = K3ForCausalLM(ModelConfig.from_preset(preset))
    return model.to(torch.bfloat16).eval()


def timed(fn):
    synchronize()
    t0 = time.perf_counter()
    out = fn()
    synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    student, teacher = build(args.preset, 0, device), build(args.preset, 1, device)
    vocab = student.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    context = args.prompt_len + args.new + 8
    batch = args.prompts * args.group
    sampler = Engine(student, max_context=context, max_batch=batch)
    scorer = Engine(teacher, max_context=context, max_batch=batch)
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, n=args.group, logprobs=0, seed=0)

    def sample():
        return sampler.complete(prompts, params)

    def score(outputs):
        seqs, starts = [], []
        for out in outputs:
            for c in out.outputs:
                seqs.append(out.prompt_token_ids + c.token_ids)
                starts.append(len(out.prompt_token_ids))
        return scorer.score(seqs, starts)

    first = sample()
    score(first)  # warm-up: graph capture and kernel autotune
    outputs, sample_s = timed(sample)
    sampled = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    scores, score_s = timed(lambda: score(outputs))
    scored = sum(len(s.logprobs) for s in scores)

    # Baseline: the bare CUDA-graph decode step of the same student at the same batch (no scheduler).
    bare_s, bare_tps = float("nan"), float("nan")
    if device.type == "cuda":
        from decode import synthetic_static
        from static_decode import CUDAGraphDecoder

        static = synthetic_static(student.config, batch, args.prompt_len, context, device)
        decoder = CUDAGraphDecoder(student, static)
        ids = torch.randint(0, vocab, (batch, 1), device=device)
        saved = static.snapshot()
        decoder.greedy(ids, 8)
        static.restore(saved)
        _, bare_s = timed(lambda: decoder.greedy(ids, args.new))
        bare_tps = batch * args.new / bare_s

    r = dict(preset=args.preset, prompts=args.prompts, group=args.group, prompt_len=args.prompt_len,
             new=args.new, sampled_tokens=sampled, sample_s=sample_s, sample_tokens_per_s=sampled / sample_s,
             scored_tokens=scored, score_s=score_s, score_tokens_per_s=scored / score_s,
             bare_graph_decode_tokens_per_s=bare_tps, engine_vs_bare=(sampled / sample_s) / bare_tps)
    print(r, flush=True)
    print_table(f"On-policy distillation, `{args.preset}` student and teacher, bf16, {args.prompts} prompts x "
                f"{args.group} samples, {args.prompt_len} + {args.new} tokens, on {device_name()}",
                ["stage", "tokens", "seconds", "tokens/s", "vs bare graph decode"],
                [["student sampling (Engine.complete, n forks)", sampled, sample_s, r["sample_tokens_per_s"],
                  f"{r['engine_vs_bare']:.2f}x"],
                 ["teacher scoring (Engine.score, packed prefill)", scored, score_s, r["score_tokens_per_s"], ""],
                 ["bare CUDA-graph decode, same batch (baseline)", batch * args.new, bare_s, bare_tps, "1.00x"]])
    write_json(args.out, {"bench": "distill", **r})


if __name__ == "__main__":
    main()
