"""`k3 rl demo`: supervised warm start, then RL, on the calc suite, on a CPU in about a quarter of an hour.

1. The calc suite's solver writes demonstrations (every tool call run in a real sandbox).
2. A byte-level BPE is trained on them and a small K3-architecture model (KDA + MLA layers, AttnRes, a latent
   MoE) is fine-tuned on them from scratch (`k3 sft` in Python): it learns the chat and tool-call format and
   to copy the task into Python and the output into submit. 3,000 demonstrations and 700 steps take it to
   0.85-0.91 greedy on held-out tasks; the earlier 1,000 and 350 left it at 0.445 (docs/rl.md, "Measured").
3. Held-out pass rate after SFT: greedy (one episode per task) and sampled at temperature 1 (the policy RL
   trains; the mean over 4 episodes per task, seeded alike before and after RL, so the paired comparison has
   less noise than one sample gives), every tool call executed in a sandbox.
4. RL on calc's training split (`k3 rl` in Python), then the same held-out evaluations.

It prints the pass rates with their binomial standard errors, the paired comparison on the same held-out tasks
(tasks gained and lost by RL), and writes the curves (DIR/rl/metrics.png).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch

from k3.checkpoint.native import atomic_write_bytes
from k3.config import ModelConfig
from k3.model import K3ForCausalLM
from k3.rl.demos import read_demonstrations, write_demonstrations
from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.chat_format import render_message_text
from k3.rl.sft import SFTConfig, SFTTrainer
from k3.train.demo import idle_cores

DEMO_MARKER = "rl_demo.json"
# RL draws training tasks from index 0 on (k3.rl.loop.TaskSource); the demonstrations come from indices far past
# those, so RL learns on tasks SFT never saw. Held-out tasks are disjoint from both (k3.rl.suites.prompt_split).
DEMO_START = 1_000_000
# moe_balancing: the loss-free bias update instead of Quantile Balancing. At this size QB's per-batch solve
# (kthvalue / topk) was ~45% of a CPU SFT step; RL freezes the bias either way (routers run in eval mode).
MODEL = dict(vocab_size=512, hidden_size=96, num_layers=4, full_attn_layers=[2, 4], kda_num_heads=2,
             kda_head_dim=32, mla_num_heads=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, attn_res_block_size=2, intermediate_size=256, num_experts=8,
             num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=64, moe_latent_size=48,
             moe_balancing="loss_free")


def standard_error(rate: float, n: int) -> float:
    return math.sqrt(max(rate * (1 - rate), 1e-12) / max(n, 1))


def paired_change(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Before/after outcomes on the same tasks (passed: True/False, or a task's share of passed samples): tasks
    gained and lost (the outcome rose / fell), the change in pass rate (the mean of the per-task differences d)
    and its standard error as a paired difference, sqrt((mean(d^2) - mean(d)^2) / n); for pass/fail outcomes
    mean(d^2) = (gained + lost) / n. Smaller than the unpaired error because tasks solved (or missed) both times
    add no noise to the difference."""
    tasks = sorted(set(before) & set(after))
    n = max(len(tasks), 1)
    differences = [float(after[t]) - float(before[t]) for t in tasks]
    gained = sum(d > 0 for d in differences)
    lost = sum(d < 0 for d in differences)
    change = sum(differences) / n
    spread = sum(d * d for d in differences) / n - change ** 2
    return {"tasks_gained": gained, "tasks_lost": lost, "paired_change": change,
            "paired_standard_error": math.sqrt(max(spread, 0.0) / n)}


def run_rl_demo(out: str = "runs/rl-demo", demos: int = 3000, sft_steps: int = 700, rl_steps: int = 24,
                heldout: int = 200, group: int = 8, tasks_per_step: int = 16, algo: str = "gspo",
                lr: float = 1e-4, sft_lr: float = 3e-3, threads: int = 0, json_path: str | None = None,
                seed: int = 0, samples: int = 4, log=None) -> dict:
    """Run the demo (see the module doc); returns the summary that --json writes. samples: episodes per held-out
    task in the sampled (temperature 1) evaluation; its pass rate is their mean."""
    started = time.perf_counter()
    log = log or (lambda message: print(message, flush=True))
    out_dir = Path(out)
    if out_dir.exists():
        if not (out_dir / DEMO_MARKER).is_file():
            raise ValueError(f"{out_dir} exists and was not written by `k3 rl demo`; choose another --out")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    atomic_write_bytes(out_dir / DEMO_MARKER, b"{}\n")
    # Oversubscribed OpenMP threads spin-wait: on a busy 2-core machine one thread runs far faster than two.
    torch.set_num_threads(threads or idle_cores())
    torch.manual_seed(seed)
    demos_path = out_dir / "demos.jsonl"
    made = write_demonstrations("calc", demos, demos_path, start=DEMO_START, show_progress=False)
    log(f"[{time.perf_counter() - started:5.0f} s] {made['examples']} calc demonstrations written "
        f"({made['solved']} solved by the solver, {made['sandbox_calls']} tool calls run in sandboxes)")

    from k3.data.tokenizer import train_bpe

    texts = ["".join(render_message_text(m["role"], m["content"]) for m in messages)
             for messages in read_demonstrations(demos_path)]
    tokenizer = train_bpe(texts, MODEL["vocab_size"], show_progress=False)
    config = ModelConfig(**{**ModelConfig.from_preset("debug").to_dict(), **MODEL,
                            "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id})
    model = K3ForCausalLM(config)
    log(f"[{time.perf_counter() - started:5.0f} s] model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"parameters, tokenizer {tokenizer.vocab_size} ids")
    sft = SFTTrainer(SFTConfig(data=str(demos_path), out=str(out_dir / "sft"), steps=sft_steps, batch_size=16,
                               lr=sft_lr, warmup_steps=10, seed=seed, save_every=sft_steps, device="cpu"),
                     model=model, tokenizer=tokenizer, show_progress=False)
    sft_summary = sft.train()
    log(f"[{time.perf_counter() - started:5.0f} s] SFT: {sft_summary['steps']} steps, loss "
        f"{sft_summary['first_loss']:.3f} -> {sft_summary['last_loss']:.3f}")

    rl_config = RLConfig(run=str(out_dir / "sft"), suite="calc", out=str(out_dir / "rl"), algo=algo, group=group,
                         tasks_per_step=tasks_per_step, steps=rl_steps, lr=lr, heldout_every=rl_steps,
                         heldout_tasks=heldout, save_every=rl_steps, seed=seed, max_context=1024, device="cpu",
                         dynamic_sampling=True)
    trainer = RLTrainer(rl_config, show_progress=False, log=lambda *_: None)
    before = trainer.evaluate(outcomes=True)
    before_sampled = trainer.evaluate(temperature=1.0, outcomes=True, samples=samples)
    before_outcomes, before_sampled_outcomes = before.pop("heldout_outcomes"), before_sampled.pop("heldout_outcomes")
    log(f"[{time.perf_counter() - started:5.0f} s] held-out pass rate after SFT: {before['heldout_pass_rate']:.3f} "
        f"+- {standard_error(before['heldout_pass_rate'], before['heldout_tasks']):.3f} greedy, "
        f"{before_sampled['heldout_pass_rate']:.3f} sampled at temperature 1 (mean of {samples} samples a task; "
        f"{before['heldout_tasks']} tasks)")
    trainer.metrics.write({"step": 0, **before})
    config_heldout, trainer.config.heldout_tasks = trainer.config.heldout_tasks, 0  # scored once, at the end
    tool_calls = before["heldout_sandbox_calls"] + before_sampled["heldout_sandbox_calls"]
    for _ in range(rl_steps):
        record = trainer.train_step()
        tool_calls += record["sandbox_calls"]
        trainer.metrics.write(record)
        log(f"[{time.perf_counter() - started:5.0f} s] RL step {trainer.step}: reward {record['reward_mean']:.3f}, "
            f"pass rate {record['pass_rate']:.3f}, tool calls/episode {record['tool_calls']:.2f}, "
            f"entropy {record.get('entropy', float('nan')):.3f}")
    trainer.config.heldout_tasks = config_heldout
    after = trainer.evaluate(outcomes=True)
    after_sampled = trainer.evaluate(temperature=1.0, outcomes=True, samples=samples)
    paired = paired_change(before_outcomes, after.pop("heldout_outcomes"))
    paired_sampled = paired_change(before_sampled_outcomes, after_sampled.pop("heldout_outcomes"))
    tool_calls += after["heldout_sandbox_calls"] + after_sampled["heldout_sandbox_calls"]
    trainer.metrics.write({"step": trainer.step, **after})
    trainer.save()
    trainer.plot()
    summary = {
        "sft_pass_rate": before["heldout_pass_rate"], "rl_pass_rate": after["heldout_pass_rate"],
        "heldout_tasks": after["heldout_tasks"],
        "sft_pass_rate_sampled": before_sampled["heldout_pass_rate"],
        "rl_pass_rate_sampled": after_sampled["heldout_pass_rate"],
        "sft_standard_error": standard_error(before["heldout_pass_rate"], before["heldout_tasks"]),
        "rl_standard_error": standard_error(after["heldout_pass_rate"], after["heldout_tasks"]),
        "tool_calls_executed": tool_calls + made["sandbox_calls"],
        **paired, **{f"{key}_sampled": value for key, value in paired_sampled.items()},
        "demos": made["examples"], "sft_steps": sft_summary["steps"], "rl_steps": trainer.step, "algo": algo,
        "group": group, "samples_per_task_sampled": samples,
        "tasks_per_step": tasks_per_step, "seconds": time.perf_counter() - started,
    }
    noise = math.hypot(summary["sft_standard_error"], summary["rl_standard_error"])
    summary["improved_beyond_noise"] = summary["rl_pass_rate"] - summary["sft_pass_rate"] > 2 * noise
    noise_sampled = math.hypot(standard_error(summary["sft_pass_rate_sampled"], summary["heldout_tasks"]),
                               standard_error(summary["rl_pass_rate_sampled"], summary["heldout_tasks"]))
    summary["improved_beyond_noise_sampled"] = (summary["rl_pass_rate_sampled"] - summary["sft_pass_rate_sampled"]
                                                > 2 * noise_sampled)
    summary["improved_beyond_paired_noise"] = paired["paired_change"] > 2 * paired["paired_standard_error"]
    summary["improved_beyond_paired_noise_sampled"] = (paired_sampled["paired_change"]
                                                       > 2 * paired_sampled["paired_standard_error"])
    log(f"[{summary['seconds']:5.0f} s] held-out pass rate, greedy: after SFT {summary['sft_pass_rate']:.3f}, after "
        f"RL {summary['rl_pass_rate']:.3f} (standard errors {summary['sft_standard_error']:.3f} / "
        f"{summary['rl_standard_error']:.3f}); sampled at temperature 1 ({samples} a task): "
        f"{summary['sft_pass_rate_sampled']:.3f} -> "
        f"{summary['rl_pass_rate_sampled']:.3f}; {summary['heldout_tasks']} held-out tasks, "
        f"{summary['tool_calls_executed']} tool calls run in sandboxes; curves in {out_dir / 'rl'}/metrics.png")
    log(f"same tasks before and after: greedy {paired['tasks_gained']} gained, {paired['tasks_lost']} lost "
        f"(change {paired['paired_change']:+.3f} +- {paired['paired_standard_error']:.3f} paired); sampled: the share "
        f"of passed samples rose on {paired_sampled['tasks_gained']} tasks, fell on {paired_sampled['tasks_lost']} "
        f"({paired_sampled['paired_change']:+.3f} +- {paired_sampled['paired_standard_error']:.3f})")
    if not summary["improved_beyond_noise"]:
        paired_verdict = ("beyond" if summary["improved_beyond_paired_noise"] else "not beyond")
        log(f"RL did not raise the greedy held-out pass rate beyond the unpaired noise of {summary['heldout_tasks']} "
            f"tasks (2 standard errors of the difference: {2 * noise:.3f}); on the same tasks the change is "
            f"{paired_verdict} 2 paired standard errors ({2 * paired['paired_standard_error']:.3f})")
    atomic_write_bytes(out_dir / DEMO_MARKER, (json.dumps(summary, indent=2) + "\n").encode())
    if json_path:
        atomic_write_bytes(json_path, (json.dumps(summary, indent=2) + "\n").encode())
    return summary
