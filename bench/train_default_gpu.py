"""What `k3 train --device cuda` gives by default, measured in one call on one GPU: the parts of
bench/train_default_gpu.sh (which runs each under its own timeout and says the budget of each).

    python bench/train_default_gpu.py b OUT WORK [--steps 1000 --budget-s 200]   # the 1,000-step default run
    python bench/train_default_gpu.py c OUT WORK [--steps 2000 --layers 4 --budget-s 190]  # the QB ablation
    python bench/train_default_gpu.py e OUT WORK [--budget-s 60]    # fp32-autocast and the matched config
    ... --dry-run: the same logic on the CPU at the debug preset's size (seconds), for checking the script

Every part writes its results into OUT/results.json (read, updated, written atomically) as soon as it has them,
so a part stopped by its timeout loses only what it had not finished.

b  `Trainer(TrainConfig.flat(preset="small", seq_len=4096, batch_size=4, device="cuda"))`, every other field at its
   default (graphed step, documents apart, published QB, bf16 parameters with fp32 masters, metrics read every
   10 steps): the first step's time, p50 / p99 step time per 100-step window (of the 10-step windows' means:
   the default reads the device every 10 steps, so no single step is timed), tokens/s and MFU of the whole
   run's p50, and the compiled frames after step 3 (with TORCH_LOGS=recompiles the shell counts the log's lines).
   No checkpoint is written (a `small` one is 21 GB): max_steps is one more than the steps run.
c  the balancing ablation of bench/qb_ablation.py (published QB, iterated QB, loss-free, none) on the same
   tokens and seeds, `small` cut to --layers layers at 4 x 512 (the shapes of the kernel cache's earlier
   ablation), each arm given an equal share of what is left of the budget; loss at equal tokens (the steps every
   arm ran), maxvio of the routed batch (mean, p95; over all steps and after the first 10%), dead / starved
   experts over 8 batches after training.
e  the default step with the fused master AdamW (kernels master_adamw=triton), then with torch's (the default),
   the matched Kimi-Linear config of bench/train.py through the default path, and --master-weights fp32-autocast
   (the previous default), while the budget lasts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k3.ops.triton_support import limit_triton_autotune_from_env  # noqa: E402

limit_triton_autotune_from_env()  # before anything imports fla (as the kernel cache was built)

from k3.checkpoint.native import atomic_write_bytes  # noqa: E402
from k3.train.metrics import read_metrics  # noqa: E402
from k3.train.trainer import TrainConfig, Trainer  # noqa: E402

PEAK_FLOPS = 989e12  # H100 / H200 dense bf16, as bench/common.py counts MFU
MARK_AFTER_STEP_3 = "K3-MARK: step 3 done"  # the shell counts TORCH_LOGS recompile lines after this line


def merge(out: Path, key: str, value) -> None:
    """OUT/results.json[key] = value, written atomically."""
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[key] = value
    atomic_write_bytes(path, (json.dumps(results, indent=1) + "\n").encode())


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def shape(args) -> dict:
    """The run's shape: `small` at 4 x 4096 on the GPU; the debug preset, tiny, in a dry run."""
    if args.dry_run:  # bf16 parameters and windowed metrics on the CPU too, to run the CUDA default's logic
        return dict(preset="debug", seq_len=64, batch_size=2, device="cpu", max_corpus_mb=0.3,
                    tokenizer_sample_mb=0.3, model_overrides={"vocab_size": 512}, master_weights="bf16-params",
                    log_every=10)
    return dict(preset="small", seq_len=4096, batch_size=4, device="cuda", max_corpus_mb=4.0,
                tokenizer_sample_mb=2.0)


def flops_per_token(trainer: Trainer) -> float:
    from common import k3_train_flops_per_token

    return k3_train_flops_per_token(trainer.model_config, trainer.seq_len)


def step_stats(records: list[dict], first: int, last: int) -> dict:
    """p50 / p99 / mean of step_seconds (each a window's mean) over steps first..last."""
    seconds = np.array([r["step_seconds"] for r in records if first <= r["step"] <= last])
    if not len(seconds):
        return {}
    return {"steps": f"{first}-{min(last, records[-1]['step'])}", "p50_ms": 1e3 * float(np.median(seconds)),
            "p99_ms": 1e3 * float(np.quantile(seconds, 0.99)), "mean_ms": 1e3 * float(seconds.mean())}


def run_in_chunks(trainer: Trainer, steps: int, deadline: float, chunk: int) -> None:
    while trainer.step < steps and time.perf_counter() < deadline:
        trainer.train(stop_at=min(trainer.step + chunk, steps))


def part_b(args) -> None:
    """The default CUDA training step over a long run."""
    out, work = Path(args.out), Path(args.work)
    started = time.perf_counter()
    deadline = started + args.budget_s
    # Two steps past the asked ones: the profiled step (steps + 1) must not be the run's last, whose final save
    # and evaluation (11 s of device-to-host copies) would land in its profile.
    config = TrainConfig.flat(out=str(work / "b"), max_steps=args.steps + 2, eval_every=10 ** 9, eval_batches=1,
                              save_every=10 ** 9, **shape(args))
    trainer = Trainer(config, show_progress=False, log=say)
    say(f"part b: built in {time.perf_counter() - started:.1f} s; bf16 parameters {trainer.bf16_params}, graphed "
        f"{trainer.graph_step}, log_every {trainer.log_every}")
    from torch._dynamo.utils import counters
    first = trainer.train(stop_at=3)
    print(MARK_AFTER_STEP_3, file=sys.stderr, flush=True)
    frames_after_3 = int(counters["frames"]["ok"])
    result = {"shape": f"{config.preset} {config.data.batch_size} x {config.data.seq_len}", "steps_asked": args.steps,
              "first_step_s": first.get("first_step_s"), "bf16_params": trainer.bf16_params,
              "graphed": trainer.graph_step, "log_every": trainer.log_every}
    flops = flops_per_token(trainer)
    tokens = config.data.batch_size * config.data.seq_len
    while trainer.step < args.steps and time.perf_counter() < deadline:
        run_in_chunks(trainer, min(trainer.step + 100, args.steps), deadline, 100)
        records = [r for r in read_metrics(work / "b" / "metrics.jsonl") if "loss" in r]
        windows = [step_stats(records, max(4, w * 100 + 1), w * 100 + 100) for w in range(trainer.step // 100 + 1)]
        overall = step_stats(records, 11, trainer.step)
        tps = tokens / (overall["p50_ms"] / 1e3) if overall else 0.0
        result.update(steps_run=trainer.step, seconds=time.perf_counter() - started, windows=[w for w in windows if w],
                      overall_after_step_10=overall, tokens_per_s=tps, mfu=flops * tps / PEAK_FLOPS,
                      eager_steps=trainer.eager_steps, compiled_frames_after_step_3=int(counters["frames"]["ok"])
                      - frames_after_3, last_loss=records[-1]["loss"], maxvio_last=records[-1]["maxvio"],
                      stopped="steps" if trainer.step >= args.steps else "budget")
        merge(out, "b_default_cli", result)
        say(f"part b: step {trainer.step}, p50 {overall.get('p50_ms', 0):.1f} ms, {tps:,.0f} tok/s, "
            f"MFU {100 * flops * tps / PEAK_FLOPS:.1f}%")
    atomic_write_bytes(out / "b_metrics.jsonl", (work / "b" / "metrics.jsonl").read_bytes())
    if args.profile and not args.dry_run:  # one more step under the profiler: the kernel families of the CLI step
        from train import profile_step

        profile_step(lambda: trainer.train(stop_at=trainer.step + 1), str(out / "b_profile.txt"),
                     f"the default `k3 train` step (Trainer), {result['shape']}, step {trainer.step + 1}")


def shared_tokenizer(args) -> str:
    """Part b's tokenizer (the same preset vocabulary), or one trained now in WORK/tok if part b left none."""
    made = Path(args.work) / "b" / "tokenizer"
    if (made / "tokenizer.json").is_file():
        return str(made)
    prep = Path(args.work) / "tok" / "tokenizer"
    if not (prep / "tokenizer.json").is_file():
        from k3.config import ModelConfig
        from k3.data.corpus import load_corpus
        from k3.data.tokenizer import train_bpe

        values = shape(args)
        vocab = max(ModelConfig.from_preset(values["preset"], **values.get("model_overrides", {})).vocab_size, 320)
        docs = load_corpus(None, max_bytes=int(2e6))
        train_bpe([d.text for d in docs], vocab, show_progress=False).save(prep)
    return str(prep)

ABLATION_ARMS = ("published", "iterated", "loss_free", "none")


def part_c(args) -> None:
    """Published QB, iterated QB, loss-free and no balancing on the same tokens and seeds."""
    import qb_ablation

    out, work = Path(args.out), Path(args.work)
    started = time.perf_counter()
    deadline = started + args.budget_s
    tokenizer = shared_tokenizer(args)
    say(f"part c: tokenizer {tokenizer} ({time.perf_counter() - started:.1f} s)")
    ablation = argparse.Namespace(steps=args.steps, seq=args.seq, batch=args.batch, layers=args.layers,
                                  eval_every=args.eval_every, corpus_mb=args.corpus_mb,
                                  device="cpu" if args.dry_run else "cuda")
    arms_path = out / "c_arms.json"

    def arm_trainer(arm: str, directory: Path) -> Trainer:
        config = qb_ablation.config_for(ablation, directory, arm)
        config.data.tokenizer = tokenizer
        if args.master_weights != "auto":  # the shell's fallback when part b failed with the default
            config.optim.master_weights = args.master_weights
        if args.dry_run:
            config.model_overrides = {**config.model_overrides, **shape(args)["model_overrides"]}
            config.preset = "debug"
        return Trainer(config, show_progress=False, log=lambda *_: None)

    # A few steps first, in a directory of their own, so the process's kernel compiles do not come out of the
    # first arm's share of the time (published QB ran 1,750 of 2,000 steps in its share when it paid for them).
    warm = arm_trainer(ABLATION_ARMS[0], work / "c" / "compile_warmup")
    run_in_chunks(warm, 3, deadline, 3)
    del warm
    say(f"part c: kernels compiled in a 3-step run ({time.perf_counter() - started:.1f} s)")
    arms = {}
    for index, arm in enumerate(ABLATION_ARMS):
        arm_started = time.perf_counter()
        arm_deadline = arm_started + (deadline - arm_started) / (len(ABLATION_ARMS) - index)
        trainer = arm_trainer(arm, work / "c" / arm)
        run_in_chunks(trainer, args.steps, arm_deadline, 250)
        records = [r for r in read_metrics(work / "c" / arm / "metrics.jsonl") if "loss" in r]
        loads = qb_ablation.expert_loads(trainer)
        mean_load = [sum(layer) / len(layer) for layer in loads]
        arms[arm] = {
            "steps": trainer.step, "seconds": time.perf_counter() - arm_started,
            "loss": [round(r["loss"], 5) for r in records], "maxvio": [round(r["maxvio"], 4) for r in records],
            "val_loss": {str(r["step"]): r["val_loss"] for r in read_metrics(work / "c" / arm / "metrics.jsonl")
                         if "val_loss" in r},
            "step_ms_p50": 1e3 * float(np.median([r["step_seconds"] for r in records[10:]] or [0.0])),
            "dead_experts": sum(sum(1 for v in layer if v == 0) for layer in loads),
            "starved_experts": sum(sum(1 for v in layer if v < 0.1 * m) for layer, m in zip(loads, mean_load)),
            "experts": sum(len(layer) for layer in loads),
        }
        atomic_write_bytes(arms_path, (json.dumps(arms) + "\n").encode())
        merge(out, "c_qb_ablation", ablation_summary(arms, ablation, trainer))
        say(f"part c: {arm} {trainer.step} steps in {arms[arm]['seconds']:.1f} s")
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def ablation_summary(arms: dict, ablation, trainer: Trainer) -> dict:
    """Per arm at equal tokens (the steps every arm finished): train loss over the last 100 of them, maxvio mean
    and p95 over all and after the first 10%, the last validation loss, dead / starved experts."""
    common = min(a["steps"] for a in arms.values())
    rows = {}
    for arm, a in arms.items():
        maxvio = np.array(a["maxvio"][:common])
        settled = maxvio[len(maxvio) // 10:]
        loss = np.array(a["loss"][:common])
        at_common = {int(s): v for s, v in a["val_loss"].items() if int(s) <= common}
        rows[arm] = {"steps_run": a["steps"], "train_loss_last_100_common": float(loss[-100:].mean()),
                     "val_loss_at_or_before_common": at_common[max(at_common)] if at_common else None,
                     "maxvio_mean": float(maxvio.mean()), "maxvio_p95": float(np.quantile(maxvio, 0.95)),
                     "maxvio_mean_after_10pct": float(settled.mean()),
                     "maxvio_p95_after_10pct": float(np.quantile(settled, 0.95)),
                     "dead_experts": a["dead_experts"], "starved_experts": a["starved_experts"],
                     "experts": a["experts"], "step_ms_p50": a["step_ms_p50"], "seconds": a["seconds"]}
    return {"master_weights": "bf16-params" if trainer.bf16_params else "fp32-autocast",
            "shape": f"small cut to {ablation.layers} layers ({trainer.model_config.num_layers} built), "
                     f"{ablation.batch} x {ablation.seq}", "steps_asked": ablation.steps, "common_steps": common,
            "tokens_per_step": ablation.batch * ablation.seq, "arms": rows}


def part_e(args) -> None:
    """The previous default (fp32 weights under autocast) and the matched config through the default path."""
    from train import k3_matched_config

    out, work = Path(args.out), Path(args.work)
    deadline = time.perf_counter() + args.budget_s
    tokenizer = shared_tokenizer(args)
    matched = {k: v for k, v in k3_matched_config().to_dict().items() if k not in ("eos_token_id", "bos_token_id")}
    runs = {"master_triton": {}, "default": {}, "matched_default": {"model_overrides": matched},
            "fp32_autocast": {"master_weights": "fp32-autocast"}}
    # the fused pass against the default beside it in one run, to decide the fused pass's default
    kernel_choices = {"master_triton": {"master_adamw": "triton"}, "default": {"master_adamw": "torch"}}
    results = {}
    for name, changes in runs.items():
        if time.perf_counter() > deadline - 20:
            break
        values = {**shape(args), **changes, "tokenizer": tokenizer}
        if args.dry_run and name not in ("fp32_autocast", "default"):
            continue  # the matched config is 0.5B parameters and the fused kernel needs CUDA: not a dry run
        config = TrainConfig.flat(out=str(work / "e" / name), max_steps=args.steps + 1, eval_every=10 ** 9,
                                  eval_batches=1, save_every=10 ** 9, **values)
        trainer = Trainer(config, show_progress=False, log=say, kernels=kernel_choices.get(name))
        first = trainer.train(stop_at=3)
        run_in_chunks(trainer, args.steps, deadline, 20)
        records = [r for r in read_metrics(work / "e" / name / "metrics.jsonl") if "loss" in r]
        overall = step_stats(records, 11, trainer.step)
        tokens = config.data.batch_size * config.data.seq_len
        tps = tokens / (overall["p50_ms"] / 1e3) if overall else 0.0
        results[name] = {"steps_run": trainer.step, "first_step_s": first.get("first_step_s"),
                         "bf16_params": trainer.bf16_params, "step_after_10": overall, "tokens_per_s": tps,
                         "fused_master_tensors": getattr(trainer.optimizer, "fused_stepped", None),
                         "mfu": flops_per_token(trainer) * tps / PEAK_FLOPS}
        merge(out, "e_extra", results)
        say(f"part e: {name} {results[name]}")
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["b", "c", "e"])
    parser.add_argument("out")
    parser.add_argument("work", help="a folder for the runs' files (tokenizer, data, metrics)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--corpus-mb", type=float, default=6.0)
    parser.add_argument("--master-weights", default="auto", choices=["auto", "fp32-autocast", "bf16-params"],
                        help="part c: the arms' weights (auto: the default path's)")
    parser.add_argument("--profile", action="store_true", help="part b: one more step under torch.profiler, "
                        "its kernel families in OUT/b_profile.txt")
    parser.add_argument("--dry-run", action="store_true", help="the logic on the CPU, the debug preset, tiny")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    args.steps = args.steps or {"b": 1000, "c": 2000, "e": 60}[args.part]
    {"b": part_b, "c": part_c, "e": part_e}[args.part](args)


if __name__ == "__main__":
    main()
