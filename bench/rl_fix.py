"""RL rollouts on the `fix` suite with a real-size model: rollout tokens/s, episodes per hour, and the split of
a step's time between generation, tools / sandboxes and training.

The model (default `small`, random init) is first fine-tuned for a short while on the fix solver's
demonstrations so that it writes tool calls and episodes run several turns; then RL steps are timed for each
rollout variant in turn, from the same fine-tuned weights (RL's lr is 1e-6, so the policy barely moves):
  bf16-graphs  a bf16 rollout copy of the policy, CUDA-graph decode; routing replay takes the old-policy
               pass's experts (the engine cannot record routing inside a graph)
  bf16-eager   a bf16 rollout copy, eager decode, the rollout's recorded experts replayed (the default loop)
  fp32-eager   the fp32 policy itself in the engine (the MoE takes its expert loop; no graphs)
Nothing is saved but the JSON result.

    python bench/rl_fix.py --preset small --sft-steps 60 --steps 3 --variants bf16-graphs bf16-eager \
        --out bench/results/rl_fix_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

# Before k3 pulls in fla: with K3_AUTOTUNE_CONFIGS (or K3_BENCH_AUTOTUNE_CONFIGS) set (the kernel cache's env.sh sets 4), every
# triton.autotune keeps that many configs, the set the kernel cache was tuned over.
from common import write_json

from k3.config import ModelConfig
from k3.data.tokenizer import train_bpe
from k3.model import K3ForCausalLM
from k3.rl.chat_format import render_message_text
from k3.rl.demos import read_demonstrations, write_demonstrations
from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.sft import SFTConfig, SFTTrainer


# variant -> (rollout dtype, CUDA graphs, routing source)
VARIANTS = {"bf16-graphs": ("bf16", True, "trainer"), "bf16-eager": ("bf16", False, "rollout"),
            "fp32-eager": ("fp32", False, "rollout")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--demos", type=int, default=200)
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--algo", default="gspo")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", nargs="+", default=["bf16-graphs", "bf16-eager"], choices=sorted(VARIANTS))
    parser.add_argument("--out")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="k3-rl-bench-")
    started = time.perf_counter()
    made = write_demonstrations("fix", args.demos, os.path.join(work, "demos.jsonl"), threads=8, show_progress=False)
    texts = ["".join(render_message_text(m["role"], m["content"]) for m in messages)
             for messages in read_demonstrations(os.path.join(work, "demos.jsonl"))]
    tokenizer = train_bpe(texts, 2048, show_progress=False)
    vocab = max(ModelConfig.from_preset(args.preset).vocab_size, tokenizer.vocab_size)
    config = ModelConfig.from_preset(args.preset, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = K3ForCausalLM(config)
    setup_s = time.perf_counter() - started
    sft = SFTTrainer(SFTConfig(data=os.path.join(work, "demos.jsonl"), out=os.path.join(work, "sft"),
                               steps=args.sft_steps, batch_size=16, lr=3e-4, warmup_steps=5, device=args.device,
                               save_every=10 ** 9), model=model, tokenizer=tokenizer, show_progress=False)
    t0 = time.perf_counter()
    sft_summary = sft.train()
    sft_s = time.perf_counter() - t0
    print(f"[{time.perf_counter() - started:.0f} s] setup {setup_s:.0f} s, SFT {sft_summary['steps']} steps in "
          f"{sft_s:.0f} s (loss {sft_summary['first_loss']:.3f} -> {sft_summary['last_loss']:.3f})", flush=True)
    results = {}
    for variant in args.variants:
        dtype, graphs, routing = VARIANTS[variant]
        if args.device != "cuda":
            dtype, graphs = "fp32", False
        rl = RLTrainer(RLConfig.flat(suite="fix", out=os.path.join(work, f"rl-{variant}"), algo=args.algo,
                                     group=args.group, tasks_per_step=args.tasks_per_step, steps=args.steps, lr=1e-6,
                                     heldout_tasks=0, device=args.device, max_context=4096, threads=16,
                                     rollout_dtype=dtype, cuda_graphs=graphs, routing_source=routing),
                       model=model, tokenizer=tokenizer, show_progress=False)
        records = []
        for _ in range(args.steps):
            record = rl.train_step()
            if "skipped_update" in record:
                # Every group's rewards were equal, so the step had nothing to learn; the update is still timed,
                # on the same sequences with advantages of alternating sign, so the split shows its cost.
                sequences, _ = rl.sequences(rl.last_groups)
                for i, sequence in enumerate(sequences):
                    sequence.advantage = 1.0 if i % 2 else -1.0
                t0 = time.perf_counter()
                rl.updater.update(sequences)
                record["train_s"] = time.perf_counter() - t0
                record["step_s"] += record["train_s"]
                record["train_timed_with_substitute_advantages"] = True
            records.append(record)
            print(f"[{time.perf_counter() - started:.0f} s]", json.dumps({"variant": variant, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                     for k, v in record.items()}}), flush=True)
        results[variant] = summarise(records)
        print(json.dumps({variant: {k: v for k, v in results[variant].items() if k != "per_step"}}, indent=2),
              flush=True)
        del rl
    result = {
        "preset": args.preset,
        "params": sum(p.numel() for p in model.parameters()), "algo": args.algo, "group": args.group,
        "tasks_per_step": args.tasks_per_step, "demos": made, "setup_s": setup_s, "sft_steps": sft_summary["steps"],
        "sft_s": sft_s, "sft_loss": [sft_summary["first_loss"], sft_summary["last_loss"]], "variants": results,
    }
    write_json(args.out, result)


def summarise(records: list[dict]) -> dict:
    """Throughput and the time split over the timed steps (the first step holds one-time costs: kernels,
    CUDA-graph capture), when there is more than one."""
    timed = records[1:] or records
    total = {k: sum(r.get(k, 0.0) for r in timed) for k in ("generation_s", "tool_s", "sandbox_setup_s", "verify_s",
                                                           "train_s", "step_s", "generated_tokens", "episodes")}
    return {
        "timed_steps": len(timed), "first_step_s": records[0]["step_s"],
        "rollout_tokens_per_s": total["generated_tokens"] / max(total["generation_s"], 1e-9),
        "episodes_per_hour": total["episodes"] / max(total["step_s"], 1e-9) * 3600,
        "step_s": total["step_s"] / len(timed),
        "split": {"generation": total["generation_s"] / total["step_s"],
                  "tools_and_sandboxes": (total["tool_s"] + total["sandbox_setup_s"] + total["verify_s"])
                  / total["step_s"],
                  "training": total["train_s"] / total["step_s"]},
        "pass_rate": sum(r["pass_rate"] * r["episodes"] for r in timed) / max(total["episodes"], 1),
        "turns": sum(r["turns"] * r["episodes"] for r in timed) / max(total["episodes"], 1),
        "per_step": timed,
    }


if __name__ == "__main__":
    main()
