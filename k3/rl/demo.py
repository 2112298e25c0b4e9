"""`k3 rl demo`: a warm start with headroom, then RL that finds it, in about 8 CPU-minutes.

1. The arith suite's solver writes demonstrations (`Compute 17*23-5 (it is in /work/expr.txt).`: python
   evaluates the file, submit gives the output), every tool call run in a real sandbox. A deliberately noisy
   teacher then appends one stray character to the submitted answer in ``stray_share`` (60%) of them: one
   item-independent mistake, always at the same place, that the verifier rejects.
2. A byte-level BPE (digits split) is trained on them and a small K3-architecture model (KDA + MLA layers,
   AttnRes, a latent MoE) is fine-tuned on them from scratch (`k3 sft` in Python): it learns the chat and
   tool-call format, to copy the tool's output into submit, and the teacher's habit: after the answer it
   writes the stray character about 60% of the time. Greedy decoding then writes it nearly always (pass@1
   low); samples leave it out 40% of the time (pass@k high). That gap is the headroom RL needs (Yue et al.:
   RL raises pass@1 towards the starting policy's pass@k).
3. Headroom measured before RL: on the training distribution (tasks RL draws) and on the held-out split
   (distinct prompts, none a training prompt): greedy pass@1, sampled pass@1 and pass@k (k = the group size)
   at the rollout temperature. A start without the headroom the demo needs is said so before RL starts.
4. RL on the training split (`k3 rl` in Python), then the same held-out evaluations, compared task by task.

It prints the rates with the paired change on the same held-out tasks (tasks gained and lost by RL) and writes
the curves (DIR/rl/metrics.png).
"""

from __future__ import annotations

import hashlib
import json
import math
import resource
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from k3.checkpoint.native import atomic_write_bytes
from k3.config import ModelConfig
from k3.model import K3ForCausalLM
from k3.rl.chat_format import format_tool_call, parse_tool_calls, render_message_text
from k3.rl.demos import read_demonstrations, write_demonstrations
from k3.rl.loop import RLConfig, RLTrainer, headroom_lines
from k3.rl.sft import SFTConfig, SFTTrainer
from k3.runtime import idle_cores
from k3.train.run_dir import fresh_demo_dir

DEMO_MARKER = "rl_demo.json"
SUITE = "arith"
# RL draws training tasks from index 0 on (k3.rl.loop.TaskSource); the demonstrations come from indices far past
# those, so RL learns on tasks SFT never saw. Held-out tasks are disjoint from both (k3.rl.suites.prompt_split).
DEMO_START = 1_000_000
# The noisy teacher's one mistake: this character after the answer it submits (a '!' never occurs in an answer).
STRAY = "!"
# The gate on the starting policy: pass@k - pass@1 (sampled) on the training distribution.
HEADROOM_GATE = 0.3
# The demo's target: held-out greedy pass@1 up by this much, and by more than TARGET_SE paired standard errors.
TARGET_GAIN, TARGET_SE = 0.15, 3.0
# moe_balancing: the loss-free bias update instead of Quantile Balancing. At this size QB's per-batch solve
# (kthvalue / topk) was ~45% of a CPU SFT step; RL freezes the bias either way (routers run in eval mode).
MODEL = dict(vocab_size=512, hidden_size=96, num_layers=4, full_attn_layers=[2, 4], kda_num_heads=2,
             kda_head_dim=32, mla_num_heads=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, attn_res_block_size=2, intermediate_size=256, num_experts=8,
             num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=64, moe_latent_size=48,
             moe_balancing="loss_free")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended (sandboxes included:
    their supervisors and the tool processes they ran are reaped when a sandbox closes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class PhaseClock:
    """Wall and CPU seconds per phase of the demo (a shared machine stretches wall time, CPU time much less)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        wall, cpu = time.perf_counter(), cpu_seconds()
        try:
            yield
        finally:
            self.wall[phase] = self.wall.get(phase, 0.0) + time.perf_counter() - wall
            self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu_seconds() - cpu


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


def stray_chosen(key: str, share: float) -> bool:
    """Whether the noisy teacher errs on the demonstration of task ``key``: a hash, so the same ``share`` of
    any set of tasks, the same ones on every machine."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2 ** 32 < share


def noisy_teacher(messages: list[dict], stray: str = STRAY) -> list[dict]:
    """The demonstration with ``stray`` appended to the answer of its final submit call."""
    calls = parse_tool_calls(messages[-1]["content"])
    if messages[-1]["role"] != "assistant" or len(calls) != 1 or calls[0].name != "submit":
        raise ValueError("a demonstration ends with one submit call; got " + repr(messages[-1])[:200])
    answer = str(calls[0].arguments["answer"]) + stray
    return messages[:-1] + [{"role": "assistant", "content": format_tool_call("submit", {"answer": answer})}]


def add_teacher_noise(path: Path, share: float) -> int:
    """Rewrite the demonstrations file at ``path`` with the noisy teacher's mistake in ``share`` of them;
    returns how many carry it."""
    lines, noisy = [], 0
    for text in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(text)
        if stray_chosen(row["task"], share):
            row["messages"] = noisy_teacher(row["messages"])
            noisy += 1
        lines.append(json.dumps(row))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return noisy


def run_rl_demo(out: str = "runs/rl-demo", demos: int = 1000, sft_steps: int = 300, rl_steps: int = 10,
                heldout: int = 300, group: int = 4, tasks_per_step: int = 16, algo: str = "gspo",
                lr: float = 5e-4, sft_lr: float = 3e-3, threads: int = 0, json_path: str | None = None,
                seed: int = 0, stray_share: float = 0.6, train_probe: int = 64, heldout_sampled: int = 50,
                refill_rounds: int = 1, log=None) -> dict:
    """Run the demo (see the module doc); returns the summary that --json writes. group: RL's group size and
    the k of pass@k; stray_share: the share of demonstrations with the noisy teacher's mistake; train_probe:
    training tasks scored before RL for the headroom gate; heldout_sampled: held-out tasks (the first of the
    ``heldout``) scored with ``group`` samples each for sampled pass@1 and pass@k; refill_rounds: dynamic
    sampling's refill rounds a step (each episode costs a sandbox and a rollout: one round keeps most steps
    full without doubling the late ones, whose groups mostly all pass)."""
    for name, value, least in (("demos", demos, 1), ("sft_steps", sft_steps, 1), ("rl_steps", rl_steps, 0),
                               ("heldout", heldout, 1), ("group", group, 2), ("tasks_per_step", tasks_per_step, 1),
                               ("train_probe", train_probe, 1), ("heldout_sampled", heldout_sampled, 0),
                               ("refill_rounds", refill_rounds, 0), ("threads", threads, 0)):
        if value < least:  # checked before anything is written: a bad flag costs nothing
            raise ValueError(f"k3 rl demo: {name} must be >= {least}, got {value}")
    if not (lr > 0 and sft_lr > 0 and 0 <= stray_share <= 1):
        raise ValueError(f"k3 rl demo: lr and sft_lr must be > 0 and stray_share in [0, 1]; got lr {lr}, "
                         f"sft_lr {sft_lr}, stray_share {stray_share}")
    started, cpu_started = time.perf_counter(), cpu_seconds()
    clock = PhaseClock()
    log = log or (lambda message: print(message, flush=True))

    def say(message: str) -> None:
        log(f"[{time.perf_counter() - started:5.0f} s] {message}")

    out_dir = fresh_demo_dir(out, DEMO_MARKER, "k3 rl demo")
    # Oversubscribed OpenMP threads spin-wait: on a busy 2-core machine one thread runs far faster than two.
    torch.set_num_threads(threads or idle_cores())
    torch.manual_seed(seed)
    demos_path = out_dir / "demos.jsonl"
    with clock("demonstrations"):
        made = write_demonstrations(SUITE, demos, demos_path, start=DEMO_START, show_progress=False)
        noisy = add_teacher_noise(demos_path, stray_share)
    say(f"{made['examples']} {SUITE} demonstrations written ({made['solved']} solved by the solver, "
        f"{made['sandbox_calls']} tool calls run in sandboxes); the noisy teacher put {STRAY!r} after the answer "
        f"in {noisy} of them")

    from k3.data.tokenizer import train_bpe

    with clock("tokenizer"):
        texts = ["".join(render_message_text(m["role"], m["content"]) for m in messages)
                 for messages in read_demonstrations(demos_path)]
        tokenizer = train_bpe(texts, MODEL["vocab_size"], show_progress=False, split_digits=True)
        config = ModelConfig(**{**ModelConfig.from_preset("debug").to_dict(), **MODEL,
                                "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id})
        model = K3ForCausalLM(config)
    say(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, tokenizer "
        f"{tokenizer.vocab_size} ids")
    with clock("sft"):
        sft = SFTTrainer(SFTConfig(data=str(demos_path), out=str(out_dir / "sft"), steps=sft_steps, batch_size=16,
                                   lr=sft_lr, warmup_steps=10, seed=seed, save_every=sft_steps, device="cpu"),
                         model=model, tokenizer=tokenizer, show_progress=False)
        sft_summary = sft.train()
    say(f"SFT: {sft_summary['steps']} steps, loss {sft_summary['first_loss']:.3f} -> {sft_summary['last_loss']:.3f}")

    rl_config = RLConfig.flat(run=str(out_dir / "sft"), suite=SUITE, out=str(out_dir / "rl"), algo=algo, group=group,
                              tasks_per_step=tasks_per_step, steps=rl_steps, lr=lr, heldout_every=rl_steps,
                              heldout_tasks=heldout, save_every=rl_steps, seed=seed, max_context=1024, device="cpu",
                              dynamic_sampling=True, refill_rounds=refill_rounds)
    with clock("train_probe"):
        trainer = RLTrainer(rl_config, show_progress=False, log=lambda *_: None)
        # The gate, on the training distribution: tasks of RL's own stream, k samples each.
        probe = trainer.evaluate(count=train_probe, temperature=rl_config.rollout.temperature, samples=group,
                                 split="train")
    gate = probe["heldout_pass_at_k"] - probe["heldout_pass_rate"]
    say(f"training tasks before RL ({probe['heldout_tasks']}, {group} samples each at temperature "
        f"{rl_config.rollout.temperature:g}): sampled pass@1 {probe['heldout_pass_rate']:.3f}, pass@{group} "
        f"{probe['heldout_pass_at_k']:.3f}: headroom {gate:.3f} "
        + ("(the gate of >= %.2f holds)" % HEADROOM_GATE if gate >= HEADROOM_GATE else
           "BELOW the gate of %.2f: RL has little to find on this start" % HEADROOM_GATE))
    with clock("heldout_before"):
        before = trainer.evaluate_headroom(outcomes=True, sampled_count=heldout_sampled)
    before_outcomes, before_sampled_outcomes = before.pop("heldout_outcomes"), before.pop("heldout_sampled_outcomes")
    for line in headroom_lines(before):
        say(f"after SFT: {line}")
    trainer.metrics.write({"step": 0, **before})
    config_heldout, trainer.config.heldout_tasks = trainer.config.heldout_tasks, 0  # scored at the end
    tool_calls = before["heldout_sandbox_calls"] + probe["heldout_sandbox_calls"]
    for _ in range(rl_steps):
        with clock("rl"):
            record = trainer.train_step()
        tool_calls += record["sandbox_calls"]
        trainer.metrics.write(record)
        say(f"RL step {trainer.step}: reward {record['reward_mean']:.3f}, pass rate {record['pass_rate']:.3f}, "
            f"groups kept {record['groups_kept']}/{record['groups']}, tool calls/episode {record['tool_calls']:.2f}, "
            f"entropy {record.get('entropy', float('nan')):.3f}")
    trainer.config.heldout_tasks = config_heldout
    with clock("heldout_after"):
        after = trainer.evaluate_headroom(outcomes=True, sampled_count=heldout_sampled)
    paired = paired_change(before_outcomes, after.pop("heldout_outcomes"))
    paired_sampled = paired_change(before_sampled_outcomes, after.pop("heldout_sampled_outcomes"))
    tool_calls += after["heldout_sandbox_calls"]
    for line in headroom_lines(after):
        say(f"after RL: {line}")
    trainer.metrics.write({"step": trainer.step, **after})
    with clock("save"):
        trainer.save()
        trainer.plot()
    n = after["heldout_tasks"]
    summary = {
        "sft_pass_rate": before["heldout_pass_rate"], "rl_pass_rate": after["heldout_pass_rate"],
        "heldout_tasks": n, "heldout_sampled_tasks": after["heldout_sampled_tasks"],
        "sampled_pass_rate_before": before["heldout_sampled_pass_rate"],
        "sampled_pass_rate_after": after["heldout_sampled_pass_rate"],
        "sft_pass_at_k": before["heldout_pass_at_k"], "rl_pass_at_k": after["heldout_pass_at_k"], "k": group,
        "train_sampled_pass_rate_before": probe["heldout_pass_rate"],
        "train_pass_at_k_before": probe["heldout_pass_at_k"], "train_probe_tasks": probe["heldout_tasks"],
        "headroom_before": gate, "headroom_gate": HEADROOM_GATE, "headroom_gate_passed": gate >= HEADROOM_GATE,
        "sft_standard_error": standard_error(before["heldout_pass_rate"], n),
        "rl_standard_error": standard_error(after["heldout_pass_rate"], n),
        "tool_calls_executed": tool_calls + made["sandbox_calls"],
        **paired, **{f"{key}_sampled": value for key, value in paired_sampled.items()},
        "demos": made["examples"], "noisy_demos": noisy, "stray": STRAY, "sft_steps": sft_summary["steps"],
        "rl_steps": trainer.step, "algo": algo, "group": group, "tasks_per_step": tasks_per_step, "lr": lr,
        "suite": SUITE, "seconds": time.perf_counter() - started, "cpu_seconds_total": cpu_seconds() - cpu_started,
        "phase_seconds": {k: round(v, 2) for k, v in clock.wall.items()},
        "cpu_seconds": {k: round(v, 2) for k, v in clock.cpu.items()},
    }
    summary["improved_beyond_paired_noise"] = paired["paired_change"] > TARGET_SE * paired["paired_standard_error"]
    summary["improved_beyond_paired_noise_sampled"] = (paired_sampled["paired_change"]
                                                       > TARGET_SE * paired_sampled["paired_standard_error"])
    summary["target_met"] = paired["paired_change"] >= TARGET_GAIN and summary["improved_beyond_paired_noise"]
    say(f"held-out greedy pass@1 {summary['sft_pass_rate']:.3f} -> {summary['rl_pass_rate']:.3f} "
        f"({paired['paired_change']:+.3f} +- {paired['paired_standard_error']:.3f} paired, {paired['tasks_gained']} "
        f"tasks gained, {paired['tasks_lost']} lost); sampled pass@1 {summary['sampled_pass_rate_before']:.3f} -> "
        f"{summary['sampled_pass_rate_after']:.3f} ({paired_sampled['paired_change']:+.3f} +- "
        f"{paired_sampled['paired_standard_error']:.3f}); pass@{group} {summary['sft_pass_at_k']:.3f} -> "
        f"{summary['rl_pass_at_k']:.3f}; {n} held-out tasks, {summary['tool_calls_executed']} tool calls run in "
        f"sandboxes; curves in {out_dir / 'rl'}/metrics.png")
    say("time per phase, wall / CPU seconds: " + ", ".join(
        f"{phase} {clock.wall[phase]:.0f} / {clock.cpu[phase]:.0f}" for phase in clock.wall)
        + f"; total {summary['seconds']:.0f} / {summary['cpu_seconds_total']:.0f}")
    verdict = "met" if summary["target_met"] else "NOT met"
    log(f"target (greedy +{TARGET_GAIN} and > {TARGET_SE:g} paired standard errors): {verdict}")
    atomic_write_bytes(out_dir / DEMO_MARKER, (json.dumps(summary, indent=2) + "\n").encode())
    if json_path:
        atomic_write_bytes(json_path, (json.dumps(summary, indent=2) + "\n").encode())
    return summary
