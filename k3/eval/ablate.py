"""`k3 ablate`: matched training runs that change one part of the architecture at a time.

Every arm trains the same base preset for the same steps on the same data (one tokenizer, the same token
streams and recall rows for a given seed), with one switch changed; each arm runs once per seed. Identical
configurations (an axis's reference arm is usually the preset itself) run once and are shared. Per run it
measures: the final validation loss, MQAR accuracy at the trained length and at 4x it (through the engine,
k3.eval.harness), maxvio of the routed training batches (mean and p99 after warm-up), tokens/s. The report
gives mean and spread (min-max over seeds) per arm, as a Markdown table and plots.

Axes and arms:
    attention   hybrid (3 KDA : 1 MLA, MLA at every 4th layer and the last), kda_only, mla_only, one_to_one
    residuals   attn_res (block AttnRes, the preset's block or 2), plain
    balancing   quantile (QB solved on the routed batch), quantile_single (one QB update per step, the old
                behaviour), loss_free (DeepSeek-V3 sign update, gamma 1e-3), aux_loss (auxiliary loss 1e-2,
                no bias), none
    kda_gate    lower_bound (K3), softplus (Kimi Linear)
    moe         latent (experts in the latent width), full (experts at the full hidden width; more
                parameters and FLOPs per token: matched tokens, not matched compute)

Results land in OUT/results.json after every run, so an interrupted ablation continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from k3.atomic import atomic_write_bytes
from k3.config import ModelConfig

AXES: dict[str, tuple[str, ...]] = {
    "attention": ("hybrid", "kda_only", "mla_only", "one_to_one"),
    "residuals": ("attn_res", "plain"),
    "balancing": ("quantile", "quantile_single", "loss_free", "aux_loss", "none"),
    "kda_gate": ("lower_bound", "softplus"),
    "moe": ("latent", "full"),
}
AUX_LOSS_COEF = 1e-2
MQAR_SEQUENCES = 32


@dataclasses.dataclass
class AblationSettings:
    base: str = "debug"
    axes: tuple[str, ...] = tuple(AXES)
    steps: int = 400
    seeds: int = 2
    seq_len: int = 64
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    recall_fraction: float = 0.5
    recall_pairs: int = 4
    recall_queries: int = 0  # 0: one query per pair
    recall_length: int = 0  # tokens per recall sequence, several packed into a row; 0: one per row (seq_len)
    recall_weight: float = 1.0  # loss weight of a recall answer relative to a text token
    max_corpus_mb: float = 1.0
    data: tuple[str, ...] = ()
    eval_every: int = 50
    threads: int = 1


def arm_changes(base: ModelConfig, axis: str, arm: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model overrides, TrainConfig overrides) of one arm, explicit whatever the preset's defaults are."""
    n = base.num_layers
    if axis == "attention":
        if arm == "hybrid":
            mla = set(range(4, n + 1, 4)) | {n}
            types = ["mla" if i + 1 in mla else "kda" for i in range(n)]
        elif arm == "one_to_one":
            types = ["mla" if (i + 1) % 2 == 0 else "kda" for i in range(n)]
        elif arm in ("kda_only", "mla_only"):
            types = [arm.split("_")[0]] * n
        else:
            raise ValueError(f"unknown arm {arm!r} of axis attention; choose from {AXES['attention']}")
        return {"layer_types": types}, {}
    if axis == "residuals":
        if arm not in AXES[axis]:
            raise ValueError(f"unknown arm {arm!r} of axis residuals; choose from {AXES['residuals']}")
        return {"attn_res_block_size": 0 if arm == "plain" else (base.attn_res_block_size or 2)}, {}
    if axis == "balancing":
        table = {"quantile": ({"moe_balancing": "quantile"}, {}),
                 "quantile_single": ({"moe_balancing": "quantile"}, {"qb_iters": 1}),
                 "loss_free": ({"moe_balancing": "loss_free", "loss_free_gamma": 1e-3}, {}),
                 "aux_loss": ({"moe_balancing": "none"}, {"moe_aux_loss": AUX_LOSS_COEF}),
                 "none": ({"moe_balancing": "none"}, {})}
        if arm not in table:
            raise ValueError(f"unknown arm {arm!r} of axis balancing; choose from {AXES['balancing']}")
        return table[arm]
    if axis == "kda_gate":
        if arm not in AXES[axis]:
            raise ValueError(f"unknown arm {arm!r} of axis kda_gate; choose from {AXES['kda_gate']}")
        return {"kda_gate": arm}, {}
    if axis == "moe":
        if arm == "latent":
            return {"moe_latent_size": base.moe_latent_size or base.hidden_size // 2}, {}
        if arm == "full":
            return {"moe_latent_size": None}, {}
        raise ValueError(f"unknown arm {arm!r} of axis moe; choose from {AXES['moe']}")
    raise ValueError(f"unknown axis {axis!r}; choose from {sorted(AXES)}")


def run_key(model_changes: dict, train_changes: dict, base: str, seed: int) -> str:
    """The same final configuration gives the same key, so shared reference arms run once."""
    config = ModelConfig.from_preset(base, **model_changes).to_dict()
    text = json.dumps({"model": config, "train": train_changes, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plan(settings: AblationSettings) -> list[dict[str, Any]]:
    """Every (axis, arm, seed) with its changes and run key."""
    base = ModelConfig.from_preset(settings.base)
    entries = []
    for axis in settings.axes:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; choose from {sorted(AXES)}")
        for arm in AXES[axis]:
            model_changes, train_changes = arm_changes(base, axis, arm)
            for seed in range(settings.seeds):
                entries.append({"axis": axis, "arm": arm, "seed": seed, "model": model_changes,
                                "train": train_changes, "key": run_key(model_changes, train_changes, settings.base,
                                                                       seed)})
    return entries


def mqar_trained_length(settings: AblationSettings) -> int:
    """The length of the recall sequences the runs trained on: MQAR is measured there and at 4x."""
    if settings.recall_length and settings.recall_length < settings.seq_len:
        return settings.recall_length
    return settings.seq_len


def _maxvio_stats(metrics: list[dict], warmup: int) -> tuple[float, float]:
    values = [r["maxvio"] for r in metrics if "maxvio" in r and r["step"] > warmup]
    if not values:
        return 0.0, 0.0
    return float(np.mean(values)), float(np.quantile(values, 0.99))


def run_one(entry: dict[str, Any], settings: AblationSettings, out: Path, tokenizer_path: str | None) -> dict:
    """Train one arm at one seed and measure it; returns the result row."""
    import torch

    from k3.data.synthetic import RecallTask
    from k3.eval.harness import engine_for, evaluate_examples
    from k3.eval.tasks import Filler, TaskContext, make_examples
    from k3.train.metrics import read_metrics
    from k3.train.trainer import TrainConfig, Trainer

    torch.set_num_threads(settings.threads)
    run_dir = out / "runs" / entry["key"]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # an unfinished earlier attempt: start the arm over
    config = TrainConfig.flat(preset=settings.base, out=str(run_dir), max_steps=settings.steps,
                              seq_len=settings.seq_len, batch_size=settings.batch_size, lr=settings.lr,
                              warmup_steps=settings.warmup_steps,
                              seed=entry["seed"], data=list(settings.data), max_corpus_mb=settings.max_corpus_mb,
                              tokenizer=tokenizer_path, eval_every=settings.eval_every, eval_batches=2,
                              save_every=settings.steps, recall_fraction=settings.recall_fraction,
                              recall_pairs=settings.recall_pairs, recall_queries=settings.recall_queries,
                              recall_length=settings.recall_length, recall_weight=settings.recall_weight,
                              model_overrides=dict(entry["model"]),
                              **entry["train"])
    started = time.perf_counter()
    trainer = Trainer(config, show_progress=False, log=lambda *_: None)
    summary = trainer.train()
    metrics = read_metrics(run_dir / "metrics.jsonl")
    maxvio_mean, maxvio_p99 = _maxvio_stats(metrics, settings.warmup_steps)
    model = trainer.model.eval()
    task = trainer.recall_task or RecallTask(model.config.vocab_size, settings.recall_pairs,
                                             settings.recall_queries or settings.recall_pairs)
    ctx = TaskContext(trainer.tokenizer, model.config.vocab_size, Filler(trainer.tokenizer), task)
    mqar = {}
    for factor in (1, 4):
        length = mqar_trained_length(settings) * factor
        examples = make_examples("mqar", ctx, length, MQAR_SEQUENCES, seed=1234)
        mqar[factor] = evaluate_examples(engine_for(model, trainer.tokenizer, length), "mqar", length,
                                         examples).accuracy
    return {"key": entry["key"], "seed": entry["seed"], "model": entry["model"], "train": entry["train"],
            "val_loss": summary.get("last_val_loss"), "mqar_trained": mqar[1], "mqar_4x": mqar[4],
            "mqar_chance": 1 / task.num_values, "maxvio_mean": maxvio_mean, "maxvio_p99": maxvio_p99,
            "tokens_per_s": summary["tokens_per_s"], "seconds": time.perf_counter() - started,
            "val_curve": [[r["step"], r["val_loss"]] for r in metrics if "val_loss" in r]}


def _load_results(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    return {row["key"]: row for row in json.loads(path.read_text())}


def _save_results(path: Path, results: dict[str, dict]) -> None:
    atomic_write_bytes(path, (json.dumps(list(results.values()), indent=1) + "\n").encode("utf-8"))


def _prepare_tokenizer(settings: AblationSettings, out: Path) -> str:
    """One BPE for every arm, trained once on the corpus (so every run reads the same token streams)."""
    from k3.train.trainer import TrainConfig, Trainer

    directory = out / "tokenizer"
    if (directory / "tokenizer.json").is_file():
        return str(directory)
    probe = out / "tokenizer_run"
    config = TrainConfig.flat(preset=settings.base, out=str(probe), max_steps=1, seq_len=settings.seq_len,
                              data=list(settings.data), max_corpus_mb=settings.max_corpus_mb,
                              tokenizer_sample_mb=settings.max_corpus_mb)
    trainer = Trainer(config, show_progress=False, log=lambda *_: None)
    trainer.tokenizer.save(directory)
    import shutil

    shutil.rmtree(probe)
    return str(directory)


def report_ablation(settings: AblationSettings, out: str | Path) -> list[dict]:
    """Write the report from the runs finished so far (OUT/results.json); returns the joined rows."""
    out = Path(out)
    results = _load_results(out / "results.json")
    joined = [{**entry, **results[entry["key"]], "axis": entry["axis"], "arm": entry["arm"]}
              for entry in plan(settings) if entry["key"] in results]
    if not joined:
        raise ValueError(f"{out} holds no finished runs of this plan yet (results.json)")
    from k3.eval.ablation_report import write_report

    write_report(joined, settings, out, mqar_trained_length(settings))
    return joined


def run_ablation(settings: AblationSettings, out: str | Path, workers: int = 1, log=print) -> list[dict]:
    """Run every planned run not yet in OUT/results.json (one after another, or over `workers` processes),
    then write the report. Returns the plan entries joined with their results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "settings.json", (json.dumps(dataclasses.asdict(settings), indent=1) + "\n").encode())
    entries = plan(settings)
    results_path = out / "results.json"
    results = _load_results(results_path)
    todo: dict[str, dict] = {}
    for entry in entries:
        if entry["key"] not in results:
            todo.setdefault(entry["key"], entry)
    log(f"ablation: {len(entries)} (axis, arm, seed) cells, {len(set(e['key'] for e in entries))} distinct runs, "
        f"{len(todo)} to run")
    tokenizer_path = _prepare_tokenizer(settings, out) if todo else None
    if workers <= 1:
        for i, entry in enumerate(todo.values()):
            log(f"[{i + 1}/{len(todo)}] {entry['axis']}={entry['arm']} seed {entry['seed']} ({entry['key']})")
            row = run_one(entry, settings, out, tokenizer_path)
            results[row["key"]] = row
            _save_results(results_path, results)
            log(f"    val loss {row['val_loss']:.4f}, MQAR {row['mqar_trained']:.3f} / {row['mqar_4x']:.3f} (4x), "
                f"maxvio {row['maxvio_mean']:.3f}, {row['tokens_per_s']:.0f} tok/s, {row['seconds']:.0f} s")
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with context.Pool(workers) as pool:
            pending = [pool.apply_async(run_one, (entry, settings, out, tokenizer_path)) for entry in todo.values()]
            for job in pending:
                row = job.get()
                results[row["key"]] = row
                _save_results(results_path, results)
                log(f"done {row['key']}: val loss {row['val_loss']:.4f}")
    return report_ablation(settings, out)
