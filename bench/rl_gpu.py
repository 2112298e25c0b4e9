"""RL at GPU scale on the arith suite: a 50-300M-parameter K3 model with headroom by design, GSPO with the bf16
rollout copy and CUDA-graph decode, held-out pass@1 before / after, throughput and a step's time split; then an
ablation from the same SFT weights (routing replay, TIS, GSPO vs GRPO) with held-out curves and the
train / rollout logprob gap.

Phases (each logs with a timestamp and rewrites DIR/summary.json, so a run stopped anywhere keeps what it found):
  1. doctor     `k3 sandbox doctor`: what the machine offers the sandboxes
  2. demos      arith solver demonstrations, every tool call in a real sandbox (16 threads), and the noisy
                teacher of `k3 rl demo` (a stray '!' after the answer in 60% of them); or --demos-file
  3. sft        a digit-split BPE and the model of MODEL (hidden 1024, 8 layers KDA/MLA 3:1, AttnRes, latent MoE
                of 8 experts top-2 + 1 shared: 172M parameters), SFT from scratch
  4. rl         the headroom gate (pass@k - pass@1 on training tasks), held-out greedy pass@1 on --heldout
                distinct tasks and sampled pass@1 / pass@k, GSPO steps (bf16 rollout copy, CUDA graphs, routing
                replayed from the old-policy pass), the same held-out scores after, the paired change
  5. ablation   from the SFT weights and the same seeds, --arm-steps steps per arm, each with --minibatches-ablation
                mini-batches (one mini-batch makes GSPO and GRPO the same gradient and the ratios 1), eager
                decode so the engine records each token's experts (rollout routing replay):
                  base       GSPO + rollout routing replay + TIS (cap 2)
                  no_replay  GSPO + TIS, the trainer routes afresh
                  no_tis     GSPO + replay, no truncated importance sampling
                  grpo       GRPO + replay + TIS
                held-out greedy pass@1 on --arm-heldout tasks at step 0 and every --arm-eval-every steps

Outputs in --out: summary.json, rl_gpu.png (held-out curves and logprob gap per arm), log.txt, metrics/*.jsonl.
Checkpoints stay in a scratch folder that is removed at the end.

    source .devcache/env.sh && python bench/rl_gpu.py --out runs/rl-gpu
    python bench/rl_gpu.py --tiny --device cpu --out /tmp/rl-gpu-tiny       # the same phases in minutes on a CPU
    python bench/rl_gpu.py --write-demos demos.jsonl --demos 2000            # demonstrations only, for --demos-file
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (before fla: caps triton.autotune's configs from the env)

from k3.checkpoint.native import atomic_write_bytes  # noqa: E402
from k3.config import ModelConfig  # noqa: E402
from k3.model import K3ForCausalLM  # noqa: E402
from k3.rl.chat_format import parse_tool_calls, render_message_text  # noqa: E402
from k3.rl.demo import (DEMO_START, HEADROOM_GATE, MODEL as TINY_MODEL, STRAY, SUITE,  # noqa: E402
                        add_teacher_noise, paired_change, standard_error)
from k3.rl.demos import read_demonstrations, write_demonstrations  # noqa: E402
from k3.rl.loop import RLConfig, RLTrainer  # noqa: E402
from k3.rl.sft import SFTConfig, SFTTrainer  # noqa: E402

# The GPU model: `small`'s layer shapes (hidden 1024, KDA 8 x 128 heads, its MLA) so the kernel cache built for
# `small` serves most kernels, 8 layers (KDA, KDA, KDA, MLA) x 2, and a latent MoE of 8 experts (top-2, one
# shared, expert width 1024 in a 512 latent): 172M parameters with the demo's ~420-id tokenizer. The loss-free
# bias instead of Quantile Balancing, as in the CPU demo (RL freezes the bias either way).
MODEL = dict(vocab_size=512, hidden_size=1024, num_layers=8, full_attn_layers=[4, 8], layer_types=None,
             kda_num_heads=8, kda_head_dim=128, mla_num_heads=8, q_lora_rank=384, kv_lora_rank=256,
             qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128, attn_res_block_size=4,
             intermediate_size=4096, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
             moe_intermediate_size=1024, moe_latent_size=512, moe_balancing="loss_free")
# arm -> RLConfig fields (over the ablation's common ones)
ARMS = {"base": dict(algo="gspo", routing_replay=True, tis_cap=2.0),
        "no_replay": dict(algo="gspo", routing_replay=False, tis_cap=2.0),
        "no_tis": dict(algo="gspo", routing_replay=True, tis_cap=None),
        "grpo": dict(algo="grpo", routing_replay=True, tis_cap=2.0),
        "grpo_no_replay": dict(algo="grpo", routing_replay=False, tis_cap=2.0)}
# Keys of a step record kept in the summaries (the rest stays in metrics/*.jsonl).
STEP_KEYS = ("step", "reward_mean", "pass_rate", "groups_kept", "groups", "refill_rounds", "episodes",
             "generated_tokens", "generation_s", "tool_s", "sandbox_setup_s", "verify_s", "train_s", "sync_s",
             "step_s", "rollout_tokens_per_s", "logprob_gap", "clip_fraction", "first_minibatch_clip_fraction",
             "first_minibatch_ratio_max_dev", "entropy", "grad_norm",
             "rollout_routed_share", "turns", "tool_calls", "skipped_update")


class Run:
    """The clock, the log (stdout and DIR/log.txt, flushed) and the summary rewritten after every phase."""

    def __init__(self, out: Path, deadline_s: float) -> None:
        self.out, self.deadline_s = out, deadline_s
        self.started = time.perf_counter()
        self.log_file = open(out / "log.txt", "a", encoding="utf-8", buffering=1)
        self.summary: dict = {"phases_s": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.deadline_s - self.elapsed()

    def say(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S', time.gmtime())} {self.elapsed():6.1f} s] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def save(self, phase: str | None = None, seconds: float | None = None) -> None:
        if phase is not None:
            self.summary["phases_s"][phase] = round(seconds, 2)
        self.summary["elapsed_s"] = round(self.elapsed(), 2)
        atomic_write_bytes(self.out / "summary.json", (json.dumps(self.summary, indent=2) + "\n").encode())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def phase_doctor(run: Run) -> None:
    from k3.sandbox.doctor import report, run_checks

    t0 = time.perf_counter()
    checks = run_checks()
    for line in report(checks).splitlines():
        run.say(f"doctor: {line}")
    run.summary["sandbox_doctor"] = {"ready": all(c.ok for c in checks if c.required),
                                     "checks": [c.__dict__ for c in checks]}
    run.save("doctor", time.perf_counter() - t0)


def noisy_share(path: Path) -> tuple[int, int]:
    """(demonstrations, those whose submitted answer ends with the stray character)."""
    messages = read_demonstrations(path)
    noisy = 0
    for m in messages:
        calls = parse_tool_calls(m[-1]["content"])
        noisy += bool(calls) and str(calls[-1].arguments.get("answer", "")).endswith(STRAY)
    return len(messages), noisy


def make_demos(path: Path, count: int, threads: int, stray_share: float) -> dict:
    made = write_demonstrations(SUITE, count, path, start=DEMO_START, threads=threads, show_progress=False)
    made["noisy"] = add_teacher_noise(path, stray_share)
    return made


def phase_demos(run: Run, args, work: Path) -> Path:
    t0 = time.perf_counter()
    path = work / "demos.jsonl"
    if args.demos_file:
        shutil.copyfile(args.demos_file, path)
        examples, noisy = noisy_share(path)
        made = {"examples": examples, "noisy": noisy, "from": args.demos_file}
        run.say(f"demos: {examples} read from {args.demos_file}, {noisy} with the stray {STRAY!r}")
    else:
        made = make_demos(path, args.demos, args.demo_threads, args.stray_share)
        run.say(f"demos: {made['examples']} {SUITE} demonstrations ({made['solved']} solved, {made['sandbox_calls']} "
                f"tool calls in sandboxes, {args.demo_threads} threads); the noisy teacher put {STRAY!r} after "
                f"the answer in {made['noisy']}")
    run.summary["demos"] = made
    run.save("demos", time.perf_counter() - t0)
    return path


def phase_sft(run: Run, args, work: Path, demos: Path, device: torch.device):
    from k3.data.tokenizer import train_bpe

    t0 = time.perf_counter()
    texts = ["".join(render_message_text(m["role"], m["content"]) for m in messages)
             for messages in read_demonstrations(demos)]
    tokenizer = train_bpe(texts, 512, show_progress=False, split_digits=True)
    shape = TINY_MODEL if args.tiny else MODEL
    config = ModelConfig(**{**ModelConfig.from_preset("debug").to_dict(), **shape,
                            "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id})
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = K3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    run.summary["model"] = {"parameters": params, "config": config.to_dict(), "tokenizer_ids": tokenizer.vocab_size}
    run.say(f"model: {params / 1e6:.1f}M parameters ({config.num_layers} layers {config.layer_types}, hidden "
            f"{config.hidden_size}, {config.num_experts} experts top-{config.num_experts_per_tok}), tokenizer "
            f"{tokenizer.vocab_size} ids, on {device}")
    sft = SFTTrainer(SFTConfig(data=str(demos), out=str(work / "sft"), steps=args.sft_steps,
                               batch_size=args.sft_batch, lr=args.sft_lr, warmup_steps=args.sft_warmup,
                               seed=args.seed, save_every=10 ** 9, device=str(device)),
                     model=model, tokenizer=tokenizer, show_progress=False)
    first, losses = None, []
    # In chunks, so the log shows progress and a slow machine stops at --sft-max-s rather than the deadline.
    while sft.step < args.sft_steps:
        done = sft.train(stop_at=min(sft.step + args.sft_log_every, args.sft_steps))
        first = done["first_loss"] if first is None else first
        losses.append((sft.step, done["last_loss"]))
        run.say(f"SFT step {sft.step}/{args.sft_steps}: loss {done['last_loss']:.4f}")
        if time.perf_counter() - t0 > args.sft_max_s:
            run.say(f"SFT stopped at step {sft.step}: past --sft-max-s {args.sft_max_s:g}")
            break
    model.eval()
    sft_s = time.perf_counter() - t0
    run.summary["sft"] = {"steps": sft.step, "first_loss": first, "last_loss": losses[-1][1], "losses": losses,
                          "seconds": sft_s, "steps_per_s": sft.step / sft_s, "lr": args.sft_lr,
                          "batch_size": args.sft_batch}
    run.save("sft", sft_s)
    del sft
    return model, tokenizer


def rl_config(args, device: torch.device, out: Path, **fields) -> RLConfig:
    base = dict(suite=SUITE, out=str(out), algo="gspo", group=args.group, tasks_per_step=args.tasks_per_step,
                steps=10 ** 6, lr=args.lr, heldout_tasks=0, seed=args.seed, max_context=1024,
                device=str(device), threads=args.threads, dynamic_sampling=True, temperature=1.0)
    if device.type == "cuda":
        base.update(rollout_dtype="bf16", cuda_graphs=True, routing_source="trainer")
    else:
        base.update(rollout_dtype="fp32", cuda_graphs=None, routing_source="rollout")
    base.update(fields)
    return RLConfig.flat(**base)


def new_trainer(config: RLConfig, model, tokenizer, device: torch.device) -> RLTrainer:
    """An RLTrainer over ``model``, its weight sync (rollout-copy refresh) timed into ``trainer.sync_s``."""
    trainer = RLTrainer(config, model=model, tokenizer=tokenizer, show_progress=False, log=lambda *_: None)
    trainer.sync_s = 0.0
    weights_changed = trainer._weights_changed

    def timed_weights_changed() -> None:
        t0 = time.perf_counter()
        weights_changed()
        sync(device)
        trainer.sync_s += time.perf_counter() - t0

    trainer._weights_changed = timed_weights_changed
    return trainer


def timed_step(trainer: RLTrainer) -> dict:
    """One RL step; its record with sync_s (weight sync) split out of train_s."""
    trainer.sync_s = 0.0
    record = trainer.train_step()
    record["sync_s"] = trainer.sync_s
    record["train_s"] = record["train_s"] - trainer.sync_s
    return record


def compact(record: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items() if k in STEP_KEYS}


def throughput(records: list[dict]) -> dict:
    """Rollout tokens/s, episodes per hour and the time split over the steps after the first (which pays for
    kernel compiles and graph capture), or over all when there is one."""
    timed = records[1:] or records
    total = {k: sum(r.get(k, 0.0) for r in timed) for k in ("generation_s", "tool_s", "sandbox_setup_s",
                                                            "verify_s", "train_s", "sync_s", "step_s",
                                                            "generated_tokens", "episodes")}
    step_s = max(total["step_s"], 1e-9)
    tools = total["tool_s"] + total["sandbox_setup_s"] + total["verify_s"]
    split = {"generation": total["generation_s"] / step_s, "tools_and_sandboxes": tools / step_s,
             "training": total["train_s"] / step_s, "weight_sync": total["sync_s"] / step_s}
    split["other"] = max(0.0, 1.0 - sum(split.values()))
    return {"timed_steps": len(timed), "first_step_s": records[0]["step_s"], "step_s": step_s / len(timed),
            "rollout_tokens_per_s": total["generated_tokens"] / max(total["generation_s"], 1e-9),
            "episodes_per_hour": total["episodes"] / step_s * 3600, "split": split,
            "seconds": {k: total[k] / len(timed) for k in ("generation_s", "train_s", "sync_s")}
            | {"tools_and_sandboxes_s": tools / len(timed)}}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode())


def phase_rl(run: Run, args, work: Path, model, tokenizer, device: torch.device) -> None:
    t0 = time.perf_counter()
    trainer = new_trainer(rl_config(args, device, work / "rl"), model, tokenizer, device)
    config = trainer.config
    result: dict = {"config": {k: v for k, v in config.to_dict().items() if k not in ("run", "out")}}
    run.summary["rl"] = result
    probe = trainer.evaluate(count=args.train_probe, temperature=config.rollout.temperature, samples=args.group,
                             split="train")
    gate = probe["heldout_pass_at_k"] - probe["heldout_pass_rate"]
    result["gate"] = {"tasks": probe["heldout_tasks"], "sampled_pass_rate": probe["heldout_pass_rate"],
                      f"pass_at_{args.group}": probe["heldout_pass_at_k"], "headroom": gate,
                      "gate": HEADROOM_GATE, "passed": gate >= HEADROOM_GATE}
    run.say(f"gate on {probe['heldout_tasks']} training tasks x {args.group} samples: sampled pass@1 "
            f"{probe['heldout_pass_rate']:.3f}, pass@{args.group} {probe['heldout_pass_at_k']:.3f}, headroom "
            f"{gate:.3f} ({'holds' if gate >= HEADROOM_GATE else 'BELOW'} the gate of {HEADROOM_GATE})")
    run.save()
    before = scores(trainer, args, run, "before RL")
    result["before"] = {k: v for k, v in before.items() if not k.endswith("outcomes")}
    run.save("rl_before_eval", time.perf_counter() - t0)
    records = [{"step": 0, **result["before"]}]
    t1 = time.perf_counter()
    while trainer.step < args.rl_steps:
        if time.perf_counter() - t1 > args.rl_max_s:
            run.say(f"RL stopped after step {trainer.step}: past --rl-max-s {args.rl_max_s:g}")
            break
        record = timed_step(trainer)
        records.append(record)
        write_jsonl(run.out / "metrics" / "rl.jsonl", records)
        run.say(f"RL step {trainer.step}: {json.dumps(compact(record))}")
    result["steps"] = trainer.step
    result["step_records"] = [compact(r) for r in records[1:]]
    if records[1:]:
        result["throughput"] = throughput(records[1:])
        tp = result["throughput"]
        run.say(f"RL throughput (steps 2..{trainer.step}): {tp['rollout_tokens_per_s']:.0f} rollout tokens/s, "
                f"{tp['episodes_per_hour']:.0f} episodes/h, step {tp['step_s']:.2f} s split "
                + ", ".join(f"{k} {v:.1%}" for k, v in tp["split"].items()))
    run.save("rl_steps", time.perf_counter() - t1)
    t2 = time.perf_counter()
    after = scores(trainer, args, run, "after RL")
    result["after"] = {k: v for k, v in after.items() if not k.endswith("outcomes")}
    records.append({"step": trainer.step, **result["after"]})
    write_jsonl(run.out / "metrics" / "rl.jsonl", records)
    greedy = paired_change(before["heldout_outcomes"], after["heldout_outcomes"])
    sampled = paired_change(before["heldout_sampled_outcomes"], after["heldout_sampled_outcomes"])
    n = after["heldout_tasks"]
    result["heldout_greedy"] = {"before": before["heldout_pass_rate"], "after": after["heldout_pass_rate"],
                                "tasks": n, "standard_error_before": standard_error(before["heldout_pass_rate"], n),
                                "standard_error_after": standard_error(after["heldout_pass_rate"], n), **greedy}
    result["heldout_sampled"] = {"before": before["heldout_sampled_pass_rate"],
                                 "after": after["heldout_sampled_pass_rate"],
                                 "tasks": after["heldout_sampled_tasks"], **sampled}
    run.say(f"held-out greedy pass@1 {before['heldout_pass_rate']:.3f} -> {after['heldout_pass_rate']:.3f} on {n} "
            f"tasks: {greedy['paired_change']:+.3f} +- {greedy['paired_standard_error']:.3f} paired "
            f"({greedy['tasks_gained']} gained, {greedy['tasks_lost']} lost); sampled pass@1 "
            f"{before['heldout_sampled_pass_rate']:.3f} -> {after['heldout_sampled_pass_rate']:.3f} "
            f"({sampled['paired_change']:+.3f} +- {sampled['paired_standard_error']:.3f}); pass@{args.group} "
            f"{before.get('heldout_pass_at_k', math.nan):.3f} -> {after.get('heldout_pass_at_k', math.nan):.3f}")
    run.save("rl_after_eval", time.perf_counter() - t2)
    close(trainer)


def scores(trainer: RLTrainer, args, run: Run, when: str) -> dict:
    """Held-out greedy pass@1 on --heldout distinct tasks; sampled pass@1 and pass@k on the first
    --heldout-sampled of them; with per-task outcomes for the paired change."""
    t0 = time.perf_counter()
    found = trainer.evaluate_headroom(count=args.heldout, outcomes=True, sampled_count=args.heldout_sampled)
    found["eval_s"] = time.perf_counter() - t0
    run.say(f"{when}: held-out greedy pass@1 {found['heldout_pass_rate']:.3f} on {found['heldout_tasks']} tasks, "
            f"sampled pass@1 {found['heldout_sampled_pass_rate']:.3f}, pass@{found['heldout_samples']} "
            f"{found['heldout_pass_at_k']:.3f} on {found['heldout_sampled_tasks']} ({found['eval_s']:.1f} s, "
            f"{found['heldout_sandbox_calls']} sandbox calls)")
    return found


def close(trainer: RLTrainer) -> None:
    trainer.close()
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def phase_ablation(run: Run, args, work: Path, model, tokenizer, sft_state: dict, device: torch.device) -> None:
    t0 = time.perf_counter()
    arms: dict = {}
    run.summary["ablation"] = {"arms": arms, "steps": args.arm_steps, "heldout_tasks": args.arm_heldout,
                               "minibatches": args.minibatches_ablation, "decode": "eager, rollout routing recorded",
                               "arms_config": {a: ARMS[a] for a in args.arms}}
    step0 = None
    for index, arm in enumerate(args.arms):
        # the shared step-0 score (and the first arm's kernel warm-up in it) is paid once: not charged to each arm
        spent = [a["seconds"] - a.get("shared_eval_s", 0.0) for a in arms.values() if "seconds" in a]
        need = max(spent) if spent else 0.0
        if run.left() < need + args.reserve_s:
            run.say(f"ablation: arm {arm} skipped: {run.left():.0f} s left, the last arm took {need:.0f} s")
            arms[arm] = {"skipped": f"{run.left():.0f} s left of the deadline"}
            continue
        ta = time.perf_counter()
        model.load_state_dict(sft_state)
        model.eval()
        config = rl_config(args, device, work / f"arm-{arm}", minibatches=args.minibatches_ablation,
                           rollout_dtype="bf16" if device.type == "cuda" else "fp32", cuda_graphs=False,
                           routing_source="rollout", tasks_per_step=args.arm_tasks_per_step, lr=args.arm_lr,
                           **ARMS[arm])
        trainer = new_trainer(config, model, tokenizer, device)
        records, curve = [], []
        shared_eval_s = 0.0
        if step0 is None:  # the same SFT weights and held-out tasks for every arm: scored once
            te = time.perf_counter()
            step0 = trainer.evaluate(count=args.arm_heldout)["heldout_pass_rate"]
            shared_eval_s = time.perf_counter() - te
        curve.append((0, step0))
        result = {"config": ARMS[arm], "curve": curve, "records": [], "shared_eval_s": shared_eval_s}
        arms[arm] = result
        while trainer.step < args.arm_steps:
            record = timed_step(trainer)
            records.append(record)
            if trainer.step % args.arm_eval_every == 0 or trainer.step == args.arm_steps:
                record["heldout_pass_rate"] = trainer.evaluate(count=args.arm_heldout)["heldout_pass_rate"]
                curve.append((trainer.step, record["heldout_pass_rate"]))
            result["records"].append(compact(record) | ({"heldout_pass_rate": record["heldout_pass_rate"]}
                                                        if "heldout_pass_rate" in record else {}))
            write_jsonl(run.out / "metrics" / f"arm_{arm}.jsonl", records)
            run.say(f"arm {arm} step {trainer.step}: reward {record['reward_mean']:.3f}, logprob gap "
                    f"{record.get('logprob_gap', math.nan):.4f}, clip fraction {record.get('clip_fraction', math.nan):.4f} "
                    f"(first mini-batch {record.get('first_minibatch_clip_fraction', math.nan):.4f}, ratio - 1 up to "
                    f"{record.get('first_minibatch_ratio_max_dev', math.nan):.2e})"
                    + (f", held-out greedy {record['heldout_pass_rate']:.3f}" if "heldout_pass_rate" in record else ""))
        gaps = [r["logprob_gap"] for r in records if isinstance(r.get("logprob_gap"), float)]
        result.update(seconds=time.perf_counter() - ta, final_heldout=curve[-1][1],
                      mean_logprob_gap=sum(gaps) / len(gaps) if gaps else None)
        run.say(f"arm {arm}: held-out greedy " + " -> ".join(f"{p:.3f}" for _, p in curve)
                + f" (steps {[s for s, _ in curve]}), mean logprob gap {result['mean_logprob_gap']}, "
                  f"{result['seconds']:.0f} s")
        close(trainer)
        run.save(f"ablation_{arm}", time.perf_counter() - ta)
        safe_plot(run)
    run.save("ablation", time.perf_counter() - t0)


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    arms = run.summary.get("ablation", {}).get("arms", {})
    for arm, result in arms.items():
        if "curve" not in result:
            continue
        xs, ys = zip(*result["curve"])
        left.plot(xs, ys, "o-", label=arm)
        gap = [(r["step"], r["logprob_gap"]) for r in result["records"] if isinstance(r.get("logprob_gap"), float)]
        if gap:
            right.plot(*zip(*gap), "o-", label=arm)
    main = run.summary.get("rl", {})
    if "heldout_greedy" in main:
        left.plot([0, main["steps"]], [main["heldout_greedy"]["before"], main["heldout_greedy"]["after"]], "k--",
                  label=f"main run ({main['heldout_greedy']['tasks']} tasks)")
        gap = [(r["step"], r["logprob_gap"]) for r in main.get("step_records", [])
               if isinstance(r.get("logprob_gap"), float)]
        if gap:
            right.plot(*zip(*gap), "k--", label="main run (bf16 graphs)")
    left.set(title="held-out greedy pass@1", xlabel="RL step", ylim=(-0.02, 1.02))
    right.set(title="|training - rollout logprob| per token", xlabel="RL step")
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def safe_plot(run: Run) -> None:
    try:
        plot(run, run.out / "rl_gpu.png")
    except Exception as error:  # the numbers matter more than the picture
        run.say(f"plot failed: {error!r}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output folder (summary.json, rl_gpu.png, log.txt, metrics/)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true", help="the CPU demo's 0.6M model and small counts: a "
                        "check of every phase in minutes on a CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline-s", type=float, default=510, help="ablation arms that would end past this "
                        "(from the start) are skipped")
    parser.add_argument("--reserve-s", type=float, default=15, help="seconds kept for the plot and summary")
    parser.add_argument("--skip-doctor", action="store_true")
    parser.add_argument("--threads", type=int, default=16, help="sandbox threads of the rollouts")
    # demonstrations
    parser.add_argument("--demos", type=int, default=2000)
    parser.add_argument("--demo-threads", type=int, default=16)
    parser.add_argument("--stray-share", type=float, default=0.6)
    parser.add_argument("--demos-file", help="demonstrations written by --write-demos (teacher noise applied)")
    parser.add_argument("--write-demos", metavar="PATH", help="write the noisy demonstrations to PATH and exit")
    # SFT
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-batch", type=int, default=32)
    parser.add_argument("--sft-lr", type=float, default=5e-4)
    parser.add_argument("--sft-warmup", type=int, default=20)
    parser.add_argument("--sft-max-s", type=float, default=150)
    parser.add_argument("--sft-log-every", type=int, default=25)
    # main RL run
    parser.add_argument("--rl-steps", type=int, default=16)
    parser.add_argument("--rl-max-s", type=float, default=150, help="no new RL step starts after this long")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--train-probe", type=int, default=128)
    parser.add_argument("--heldout", type=int, default=1000)
    parser.add_argument("--heldout-sampled", type=int, default=200)
    parser.add_argument("--skip-main", action="store_true", help="ablation only")
    # ablation
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--arm-steps", type=int, default=6)
    parser.add_argument("--arm-tasks-per-step", type=int, default=16)
    parser.add_argument("--arm-lr", type=float, default=None, help="default: --lr")
    parser.add_argument("--arm-heldout", type=int, default=256)
    parser.add_argument("--arm-eval-every", type=int, default=3)
    parser.add_argument("--minibatches-ablation", type=int, default=2)
    args = parser.parse_args(argv)
    if args.tiny:  # every phase, minutes on a 2-core CPU
        for name, value in dict(demos=96, demo_threads=4, sft_steps=100, sft_batch=16, sft_lr=3e-3,
                                sft_warmup=10, sft_log_every=25, rl_steps=2, group=4, tasks_per_step=8, lr=5e-4,
                                train_probe=16, heldout=40, heldout_sampled=16, arm_steps=2, arm_tasks_per_step=4,
                                arm_heldout=16, arm_eval_every=1, threads=4).items():
            if parser.get_default(name) == getattr(args, name):
                setattr(args, name, value)
    args.arm_lr = args.lr if args.arm_lr is None else args.arm_lr
    if not args.write_demos and not args.out:
        parser.error("--out DIR is required (or --write-demos PATH)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.write_demos:
        t0 = time.perf_counter()
        made = make_demos(Path(args.write_demos), args.demos, args.demo_threads, args.stray_share)
        print(json.dumps({**made, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.deadline_s)
    # A time limit's SIGTERM unwinds through the finally below: the plot and summary of what finished survive.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cpu":  # oversubscribed OpenMP threads spin-wait: only the idle cores
        from k3.runtime import idle_cores

        torch.set_num_threads(idle_cores())
    run.summary.update(command=" ".join(sys.argv), device=torch.cuda.get_device_name() if device.type == "cuda"
                       else "cpu", torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       args=vars(args))
    run.say(f"rl_gpu on {run.summary['device']} (torch {torch.__version__}), deadline {args.deadline_s:g} s")
    run.save()
    work = Path(tempfile.mkdtemp(prefix="k3-rl-gpu-"))
    try:
        if not args.skip_doctor:
            phase_doctor(run)
        demos = phase_demos(run, args, work)
        model, tokenizer = phase_sft(run, args, work, demos, device)
        sft_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if not args.skip_main:
            phase_rl(run, args, work, model, tokenizer, device)
            safe_plot(run)
        if args.arms:
            phase_ablation(run, args, work, model, tokenizer, sft_state, device)
    finally:
        safe_plot(run)
        run.save()
        shutil.rmtree(work, ignore_errors=True)
        run.say(f"done in {run.elapsed():.0f} s; {out}/summary.json")


if __name__ == "__main__":
    main()
