"""`k3 distill demo`: two domain teachers distilled into one student, on a CPU, in about a quarter of an hour.

1. Two domains from text on this machine: "code" (the Python standard library's sources) and "docs" (the
   English documentation pydoc ships, pydoc_data/topics.py). One byte-level BPE is trained on both: teachers
   and student share it.
2. Two teachers, one per domain, are trained with `k3 train` (k3.train.Trainer) on their own domain only; the
   student, the same architecture, is trained on both domains for a fifth of the steps (a weak generalist).
3. Three arms of `k3 distill` from that student, each domain's prompts scored by its own teacher, with the same
   prompts, samples and completion length per step and the same number of steps (equal student compute):
   on-policy with the per-token sampled advantage (the RL step), on-policy with the exact reverse KL over the
   vocabulary at the student's own sampled positions ("on-policy full"), and the offline baseline (SFT on
   teacher samples).

It prints, per domain: the exact reverse KL of the student to that domain's teacher on fixed held-out prompts
(the teacher's own is 0), and the held-out loss (NLL per token of the reference text), before and after, next
to the teacher's own, and the share of the reverse-KL gap closed, 1 - after / before.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from k3.atomic import atomic_write_bytes
from k3.runtime import idle_cores
from k3.train.run_dir import fresh_demo_dir

DEMO_MARKER = "distill_demo.json"
VOCAB = 512
# The debug preset's shape (KDA + MLA layers, AttnRes, a latent MoE): a 2-core CPU trains it at a few steps/s.


def _write_domains(data_dir: Path, code_mb: float) -> dict[str, Path]:
    from pydoc_data.topics import topics

    from k3.data.corpus import stdlib_directory

    data_dir.mkdir(parents=True, exist_ok=True)
    code, used = [], 0
    for path in sorted(stdlib_directory().glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        code.append(json.dumps({"text": text}))
        used += len(text)
        if used > code_mb * 1e6:
            break
    docs = [json.dumps({"text": text}) for _, text in sorted(topics.items())]
    paths = {"code": data_dir / "code.jsonl", "docs": data_dir / "docs.jsonl"}
    atomic_write_bytes(paths["code"], ("\n".join(code) + "\n").encode())
    atomic_write_bytes(paths["docs"], ("\n".join(docs) + "\n").encode())
    return paths


def _train(out: Path, data: list[Path], tokenizer_dir: Path, steps: int, seed: int, log) -> None:
    from k3.train.trainer import TrainConfig, Trainer

    config = TrainConfig.flat(preset="debug", out=str(out), max_steps=steps, seq_len=64, batch_size=8, lr=3e-3,
                              warmup_steps=10, eval_every=steps, eval_batches=4, save_every=steps, seed=seed,
                              data=[str(p) for p in data], tokenizer=str(tokenizer_dir), device="cpu",
                              model_overrides={"vocab_size": VOCAB})
    summary = Trainer(config, log=lambda *_: None, show_progress=False).train()
    log(f"  {out.name}: {steps} steps, val loss {summary.get('first_val_loss', float('nan')):.3f} -> "
        f"{summary.get('last_val_loss', float('nan')):.3f}")


# The arms, all from the same student with the same prompts, samples and completion length per step and the
# same number of steps (equal student compute): label, DistillConfig fields.
# "on-policy": the per-token advantage log p_teacher - log p_student of each sampled token through the RL
# policy-gradient step (minus the batch's mean advantage). "on-policy full": the same student samples, with the
# exact reverse KL over the whole vocabulary at each of their positions as the loss (estimator topk with
# top_k = the vocabulary). "offline": SFT on teacher samples.
ARMS = (("on-policy", {"mode": "on-policy", "estimator": "sampled", "baseline": True}),
        ("on-policy full", {"mode": "on-policy", "estimator": "topk", "top_k": VOCAB}),
        ("offline", {"mode": "offline"}))
KEYS = {"on-policy": "student", "on-policy full": "full", "offline": "offline"}


def run_distill_demo(out: str = "runs/distill-demo", teacher_steps: int = 300, student_steps: int = 60,
                     distill_steps: int = 300, lr: float = 2e-3, prompts_per_domain: int = 8, samples: int = 4,
                     json_path: str | None = None, seed: int = 0, threads: int = 0,
                     log=print) -> dict:
    """Run the demo (see the module doc); returns the per-domain summary that --json writes."""
    from k3.data.tokenizer import train_bpe
    from k3.rl.distill import DistillConfig, DistillTrainer
    from k3.rl.distill_sources import LocalTeacher

    started = time.perf_counter()

    def say(text: str) -> None:
        log(f"[{time.perf_counter() - started:5.0f} s] {text}")

    out_dir = fresh_demo_dir(out, DEMO_MARKER, "k3 distill demo")
    # Oversubscribed OpenMP threads spin-wait: on a busy 2-core machine one thread ran this demo ~10x faster.
    torch.set_num_threads(threads or idle_cores())
    torch.manual_seed(seed)
    paths = _write_domains(out_dir / "data", code_mb=0.5)
    sample = [json.loads(line)["text"] for p in paths.values()
              for line in p.read_text(encoding="utf-8").splitlines()[:200]]
    tokenizer = train_bpe(sample, VOCAB, show_progress=False)
    tokenizer.save(out_dir / "tokenizer")
    say(f"domains: code ({paths['code'].stat().st_size / 1e6:.1f} MB of stdlib sources), docs "
        f"({paths['docs'].stat().st_size / 1e6:.1f} MB of pydoc topics); shared BPE of {tokenizer.vocab_size} ids")
    say("training the teachers (each on its own domain) and the student (both domains, fewer steps)")
    _train(out_dir / "teacher-code", [paths["code"]], out_dir / "tokenizer", teacher_steps, seed, say)
    _train(out_dir / "teacher-docs", [paths["docs"]], out_dir / "tokenizer", teacher_steps, seed, say)
    _train(out_dir / "student", [paths["code"], paths["docs"]], out_dir / "tokenizer", student_steps, seed, say)
    teachers = {name: LocalTeacher.load(name, str(out_dir / f"teacher-{name}"), "cpu", 512) for name in paths}
    results = {}
    for label, fields in ARMS:
        config = DistillConfig.flat(
            student=str(out_dir / "student"), teachers={n: str(out_dir / f"teacher-{n}") for n in paths},
            data={n: str(p) for n, p in paths.items()}, out=str(out_dir / label.replace(" ", "-")),
            steps=distill_steps, prompts_per_domain=prompts_per_domain, samples=samples, prompt_tokens=16,
            reference_tokens=16, max_new_tokens=16, lr=lr, heldout_prompts=16, heldout_samples=1,
            heldout_every=max(1, distill_steps // 5), save_every=distill_steps, seed=seed, max_context=512,
            device="cpu", **fields)
        # A progress bar per arm (each runs minutes) where someone watches; logs stay free of bar redraws.
        trainer = DistillTrainer(config, log=lambda *_: None, show_progress=sys.stderr.isatty(), teachers=teachers)
        summary = trainer.train()
        results[label] = (summary["first"], summary["last"])
        rkl = ", ".join(f"{d} {summary['first'][f'heldout_rkl/{d}']:.3f} -> {summary['last'][f'heldout_rkl/{d}']:.3f}"
                        for d in paths)
        say(f"{label}: {distill_steps} steps; held-out reverse KL {rkl}")
    before = results[ARMS[0][0]][0]
    table = {}
    for d in paths:
        kl_before = before[f"heldout_rkl/{d}"]
        row = {"student_kl_before": kl_before, "teacher_heldout_nll": before[f"teacher_heldout_nll/{d}"],
               "student_heldout_nll_before": before[f"heldout_nll/{d}"]}
        for label, _ in ARMS:
            key, last = KEYS[label], results[label][1]
            row[f"{key}_kl_after"] = last[f"heldout_rkl/{d}"]
            row[f"{key}_gap_closed"] = 1 - last[f"heldout_rkl/{d}"] / kl_before
            row[f"{key}_heldout_nll_after"] = last[f"heldout_nll/{d}"]
        table[d] = row
    labels = [label for label, _ in ARMS]
    log("\nper domain, after the same number of steps of each arm from the same student: reverse KL to that "
        "domain's teacher (exact over the vocabulary, on the student's own completion of each of 16 held-out "
        "prompts; the teacher's own is 0; the share of the gap closed, 1 - after / before, in brackets) and NLL "
        "per token of the held-out reference text:")
    log(f"{'domain':7s} {'KL before':>9s} " + " ".join(f"{label:>15s}" for label in labels)
        + f" | {'NLL teacher':>11s} {'before':>7s} " + " ".join(f"{label:>15s}" for label in labels))
    for d, row in table.items():
        kls = " ".join(f"{row[KEYS[label] + '_kl_after']:7.3f} ({100 * row[KEYS[label] + '_gap_closed']:3.0f}%)"
                       for label in labels)
        nlls = " ".join(f"{row[KEYS[label] + '_heldout_nll_after']:15.3f}" for label in labels)
        log(f"{d:7s} {row['student_kl_before']:9.3f} {kls} | {row['teacher_heldout_nll']:11.3f} "
            f"{row['student_heldout_nll_before']:7.3f} {nlls}")
    summary = {"domains": table, "arms": {label: fields for label, fields in ARMS}, "teacher_steps": teacher_steps,
               "student_steps": student_steps, "distill_steps": distill_steps, "lr": lr,
               "prompts_per_domain": prompts_per_domain, "samples": samples,
               "seconds": time.perf_counter() - started}
    say(f"done; curves in {out_dir}/{{{','.join(label.replace(' ', '-') for label in labels)}}}/metrics.png")
    atomic_write_bytes(out_dir / DEMO_MARKER, (json.dumps(summary, indent=2) + "\n").encode())
    if json_path:
        atomic_write_bytes(json_path, (json.dumps(summary, indent=2) + "\n").encode())
    return summary
