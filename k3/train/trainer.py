"""The training loop: data -> tokenizer -> packed batches -> K3ForCausalLM -> AdamW, with QB bias updates,
metrics, plots, periodic atomic checkpoints and exact resume.

Run directory layout:
    train_config.json   the TrainConfig
    config.json         the ModelConfig
    tokenizer/          the tokenizer files (trained on the corpus on first use unless one was given)
    data/train.bin      token streams (int32, EOS after each document), fixed at the first run so a resumed
    data/val.bin        run reads exactly the same data
    checkpoint.pt       the last good checkpoint (see k3.checkpoint.native), or with checkpoint_format
    checkpoint/         "sharded" a torch.distributed.checkpoint directory of every rank's shards
    metrics.jsonl       one JSON per step; metrics.png the curves
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from k3.checkpoint.native import (CHECKPOINT_NAME, atomic_write_bytes, directory_files, load_checkpoint,
                                  load_model_state, save_checkpoint)
from k3.checkpoint.run import FORMATS as CHECKPOINT_FORMATS
from k3.checkpoint.run import checkpoint_path, saved_format
from k3.config import ModelConfig
from k3.layers.balancing import QB_AGGREGATES, QB_PUBLISHED
from k3.runtime import autocast_dtype, resolve_device
from k3.runtime import rng_state as _rng_state, set_rng_state as _set_rng_state
from k3.data.corpus import load_corpus, split_validation
from k3.data.packing import BatchStream, PackedBatch, load_stream, save_stream, text_row, pack_rows, \
    tokenize_documents
from k3.data.synthetic import RecallTask
from k3.data.tokenizer import load_tokenizer, train_bpe
from k3.distributed.loop import clip_grad_norm_
from k3.kernels import applied as kernels_applied
from k3.model import K3ForCausalLM, pad_cu_seqlens
from k3.train.graphed_step import QB_GRAPH_UPDATES, GraphedTrainStep
from k3.train.master_weights import MASTER_WEIGHTS, MasterWeightAdamW
from k3.train.metrics import MetricsLog, plot_metrics
from k3.train.optim import build_optimizer, lr_at
from k3.train.profile import PROFILE_AFTER, StepProfiler
from k3.train.schedule import check_seq_len_schedule, rows_for, stage_at


@dataclass
class TrainConfig:
    preset: str = "tiny"
    out: str = "runs/tiny"
    max_steps: int = 200
    seq_len: int = 256
    batch_size: int = 8  # rows of seq_len tokens per step, packed into one [1, batch_size*seq_len] sequence
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "auto"  # auto: bf16 autocast on CUDA with bf16 support, fp32 elsewhere; or "fp32" / "bf16"
    device: str = "auto"
    seed: int = 0
    data: list[str] = field(default_factory=list)  # empty: the default corpus (the stdlib on this machine)
    max_corpus_mb: float | None = None  # cap on corpus text read (None: all of it)
    tokenizer: str | None = None  # a tokenizer.json / tiktoken file / directory; None: train a BPE
    tokenizer_sample_mb: float = 20.0  # text used to train the BPE
    val_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 50
    recall_fraction: float = 0.0  # share of rows replaced by synthetic recall sequences
    recall_pairs: int = 8
    recall_queries: int = 0  # queries per recall sequence (0: one per pair)
    recall_length: int = 0  # tokens per recall sequence, several packed into a row (0: one sequence per row)
    recall_weight: float = 1.0  # loss weight of a recall answer relative to a text token
    time_budget_s: float | None = None  # stop (and save) once training has run this long
    ep: int = 0  # under torchrun: ranks per EP group (divides the processes; FSDP2 over all); 0: one process
    # "full": DIR/checkpoint.pt gathered on rank 0; "sharded": DIR/checkpoint/, each rank writes its own shards
    checkpoint_format: str = "full"
    ep_balanced: bool = False  # under --ep: MoonEP-style balanced dispatch (replicates the hottest experts)
    qb_aggregate: str = "gather"  # under torchrun: QB pools ranks' statistics exactly ("gather") or by histograms
    # Length curriculum [[seq_len, start_step], ...] (k3.train.schedule); None: seq_len throughout. When given,
    # seq_len is the first stage's length and every step holds batch_size * seq_len tokens.
    seq_len_schedule: list[list[int]] | None = None
    # Quantile Balancing: 0 (QB_PUBLISHED) the published rule, one update per MoE layer and step applied at the next
    # step; N > 0 the research option, the update iterated on the routed batch until it balances (at most N).
    qb_iters: int = QB_PUBLISHED
    # Under torchrun: batch_size is the GLOBAL number of rows; every rank reads the same stream and trains its
    # contiguous share of each batch, so the run sees the same batches (and losses) under any layout and
    # resumes under another one on the same stream. False: every rank reads its own stream of batch_size rows.
    global_batch: bool = False
    moe_aux_loss: float = 0.0  # coefficient of an auxiliary balancing loss (a baseline for ablations; 0: none)
    model_overrides: dict[str, Any] = field(default_factory=dict)
    # Each step's forward and backward replayed from one CUDA graph (k3.train.graphed_step), which takes the
    # host's kernel launches out of the step. None (the default): on for a CUDA device in one process, off
    # elsewhere; False: the eager step (--eager). Packed documents stay apart in the graph through static shapes
    # (cu_seqlens padded to max_documents_per_row per row); a batch with more documents takes the eager step.
    # The iterated QB (qb_iters > 0) solves on the device with min(qb_iters, QB_GRAPH_UPDATES) updates.
    cuda_graph: bool | None = None
    max_documents_per_row: int = 0  # the graphed step's static document count per row; 0: max(16, seq_len // 128)
    # Steps whose metrics (loss, grad norm, maxvio, ...) stay on the device and are read in one host sync; every
    # step's values are still written, and step_seconds is the window's mean. 0: 10 on CUDA (a read per step
    # waits for the GPU and stalls the host's queue of work), 1 elsewhere.
    log_every: int = 0
    # How the weights are kept (k3.train.master_weights): "bf16-params" holds the model's parameters in bf16 (no
    # autocast casts) with fp32 masters in the optimizer; "fp32-autocast" fp32 parameters under --dtype's
    # autocast; "auto" bf16-params on a bf16-capable CUDA device in one process with --dtype auto or bf16 and full
    # checkpoints, fp32-autocast elsewhere (the CPU path stays fp32). Checkpoints hold fp32 weights either way.
    master_weights: str = "auto"
    # Image-text data (k3.train.images; a --data .jsonl with "images" or "messages" records): the tower trained
    # with the model. vision: a vision preset for the new tower (None: "k3" for the k3 preset, else "tiny");
    # vision_train: "all" (tower + projector), "projector" (tower frozen) or "none"; vision_lr: None = lr.
    vision: str | None = None
    vision_train: str = "all"
    vision_lr: float | None = None
    image_fraction: float = 0.5  # share of each step's rows that are image-text rows
    max_image_patches: int | None = None  # images scaled down within this many 14-px patches (None: 16384)
    max_image_pixels: int | None = None  # decoded pixels an image may have (None: Pillow's MAX_IMAGE_PIXELS)
    max_image_bytes: int = 32 << 20  # bytes of an image file or data: URL
    skip_bad_images: bool = False  # leave bad image-text records out (counted) instead of stopping at the first
    allow_image_paths_outside: bool = False  # follow absolute paths and paths outside the JSONL's folder

    def __post_init__(self) -> None:
        for name in ("max_steps", "seq_len", "batch_size", "eval_batches", "eval_every", "save_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.log_every < 0:
            raise ValueError(f"log_every must be 0 (auto: 10 on CUDA, 1 elsewhere) or a positive step count, got "
                             f"{self.log_every}")
        if self.qb_iters < 0:
            raise ValueError(f"qb_iters must be 0 (published Quantile Balancing) or a positive cap on the iterated "
                             f"solve, got {self.qb_iters}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.recall_fraction <= 1:
            raise ValueError(f"recall_fraction must be in [0, 1], got {self.recall_fraction}")
        if self.recall_weight <= 0 or self.recall_length < 0 or self.recall_queries < 0:
            raise ValueError(f"recall_weight must be positive and recall_length, recall_queries >= 0; got "
                             f"{self.recall_weight}, {self.recall_length}, {self.recall_queries}")
        if self.seq_len_schedule is not None:
            self.seq_len_schedule = [[int(n), int(s)] for n, s in self.seq_len_schedule]
            check_seq_len_schedule(self.seq_len_schedule)
            self.seq_len = self.seq_len_schedule[0][0]
        if self.qb_aggregate not in QB_AGGREGATES:
            raise ValueError(f"qb_aggregate must be one of {QB_AGGREGATES}, got {self.qb_aggregate!r}")
        if self.ep_balanced and self.ep < 2:
            raise ValueError(f"ep_balanced needs expert parallelism: give --ep 2 or more (got ep={self.ep})")
        if self.cuda_graph and self.ep:  # an explicit --cuda-graph; the default (None) turns it off under --ep
            raise ValueError("cuda_graph runs on one process (QB over ranks syncs with the host); drop --ep or "
                             "--cuda-graph")
        if self.master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}, got {self.master_weights!r}")
        if self.master_weights == "bf16-params" and (self.dtype == "fp32" or self.ep
                                                     or self.checkpoint_format == "sharded"):
            raise ValueError("master_weights bf16-params runs bf16 parameters in one process with full checkpoints; "
                             f"got dtype={self.dtype!r}, ep={self.ep}, checkpoint_format={self.checkpoint_format!r} "
                             "(use --master-weights fp32-autocast, or drop those options)")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {self.checkpoint_format!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def device_maxvio(load_E: torch.Tensor) -> torch.Tensor:
    """k3.layers.balancing.maxvio as a 0-dim device tensor (no host sync): max_e(load_e / mean_load) - 1."""
    load_E = load_E.float()
    mean = load_E.mean()
    return torch.where(mean > 0, load_E.max() / mean - 1, torch.zeros_like(mean))


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean cross-entropy over the scored tokens. logits [1, T, V]; labels, weights [1, T]."""
    token_loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                 reduction="none")
    weights = weights.reshape(-1) * (labels.reshape(-1) != -100)
    return (token_loss * weights).sum() / weights.sum().clamp_min(1e-9)


class NonFiniteLossError(RuntimeError):
    pass


RUN_MARKER = ".k3-run"  # written first into a new run directory: what a later attempt may clear is k3's own


def _check_fresh_out(out: Path) -> None:
    """A new run starts in a new or empty directory, or one an earlier attempt of k3 train left: it clears
    that attempt's files, so a directory of anything else is refused."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory for the run")
    if not out.is_dir() or (out / RUN_MARKER).is_file() or (out / "train_config.json").is_file():
        return
    entries = sorted(p.name for p in out.iterdir())
    if entries:
        raise ValueError(f"--out {out} already holds files that k3 train did not write ({len(entries)} entries, "
                         f"e.g. {entries[:3]}); a new run starts in a new or empty directory: choose another --out")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(value, indent=2) + "\n").encode("utf-8"))


class Trainer:
    """Build with `Trainer(config)`, then `train()`.

    `resume=True` continues from DIR/checkpoint.pt exactly: only `config.out` is read from `config`, the rest
    comes from the checkpoint, except the fields named in `resume_overrides` (e.g. a larger max_steps; note
    that max_steps sets the cosine schedule's length, so changing it changes the learning rates that follow).
    `kernels` (k3.kernels choices, e.g. {"adamw": "torch"}) hold while the trainer builds, trains and evaluates."""

    @kernels_applied
    def __init__(self, config: TrainConfig, resume: bool = False, log: Callable[[str], None] = print,
                 show_progress: bool = True, resume_overrides: dict[str, Any] | None = None,
                 profile: str | Path | None = None, profile_at: int | None = None,
                 *, kernels: dict[str, str] | None = None) -> None:
        self.log = log
        self.profile_dir = profile  # k3.train.profile: a torch.profiler report of a few steps, written there
        if profile_at is not None and (profile is None or profile_at < 1):
            raise ValueError(f"profile_at={profile_at}: the first profiled step needs a profile directory "
                             f"(--profile DIR) and counts from 1")
        # The window's first step (counted from the run's start); None: PROFILE_AFTER steps after this session's
        # first. A later window shows a step after the router has sharpened (QB's updates grow with it).
        self.profile_at = profile_at
        self.show_progress = show_progress
        self.out = Path(config.out)
        found = saved_format(self.out)
        self.resume_state = None
        if resume:
            if found is None:
                raise FileNotFoundError(f"--resume given but {self.out} holds no finished checkpoint "
                                        f"({CHECKPOINT_NAME} or a sharded checkpoint/ directory); start the run "
                                        f"without --resume first")
            if found == "full":
                self.resume_state = load_checkpoint(self.out / CHECKPOINT_NAME)
            else:
                from k3.distributed.sharded_checkpoint import read_sharded_extra
                # Model and optimizer shards load later, into the parallel layout; here only the run's state.
                self.resume_state = read_sharded_extra(checkpoint_path(self.out, "sharded"))
                if isinstance(self.resume_state.get("rng"), str):
                    raise ValueError(f"{checkpoint_path(self.out, 'sharded')} keeps its RNG states as a pickle "
                                     "(written by an older k3); k3 no longer unpickles checkpoint metadata")
            self.resume_state["saved_format"] = found
            saved = TrainConfig(**self.resume_state["train"])
            # Data, model and optimizer settings must stay as they were, or the resumed run would diverge from
            # the unbroken one; out may move with the run directory.
            # The parallel layout is not part of the run: a resume is single-process unless --ep (and
            # --ep-balanced) are given again.
            config = dataclasses.replace(saved, out=config.out,
                                         **{"ep": 0, "ep_balanced": False, **(resume_overrides or {})})
        elif found is not None:
            raise ValueError(f"{self.out} already holds a run ({checkpoint_path(self.out, found)}); pass --resume "
                             f"to continue it or choose another --out")
        else:
            _check_fresh_out(self.out)
            # Left by an attempt that stopped before its first checkpoint: made from possibly other settings.
            for stale in ("tokenizer", "data"):
                if (Path(config.out) / stale).is_dir():
                    shutil.rmtree(Path(config.out) / stale)
        self.config = config
        from k3.train.images import split_data_files
        # A resumed run reads its data from DIR/data (kept at the first run), not from the --data files.
        self.text_data, self.image_files = split_data_files(config.data) if not resume else (config.data, [])
        self.has_images = bool(self.image_files) if not resume else "vision" in self.resume_state
        self.images = None  # k3.train.images.ImageTraining when --data holds image-text files
        self.out.mkdir(parents=True, exist_ok=True)
        if not resume:
            atomic_write_bytes(self.out / RUN_MARKER, b"")
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        random.seed(config.seed)
        self.device = resolve_device(config.device)
        self.dist = None
        if config.ep:
            # Distributed run (k3.distributed): every rank trains its own data rows; rank 0 logs and saves.
            from k3.distributed import check_ep_size, init_distributed
            self.dist = init_distributed(device=None if config.device == "auto" else config.device)
            self.device = self.dist.device
            # Before the data is prepared: a bad --ep fails at once.
            check_ep_size(config.ep, self.dist.world_size,
                          ModelConfig.from_preset(config.preset, **config.model_overrides).num_experts)
            if self.dist.rank != 0:
                self.log, self.show_progress = (lambda *_: None), False
        self.autocast = autocast_dtype(config.dtype, self.device)
        self.bf16_params = config.master_weights == "bf16-params" or (
            config.master_weights == "auto" and self.autocast == torch.bfloat16 and self.device.type == "cuda"
            and not config.ep and config.checkpoint_format == "full" and not self.has_images)
        if self.bf16_params and self.has_images:
            raise ValueError("image-text data trains with fp32 weights under autocast; drop --master-weights bf16-params")
        if self.bf16_params:
            self.autocast = None  # the parameters are bf16: nothing to cast
        if config.cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a CUDA device; this run is on {self.device} (drop --cuda-graph)")
        # The default CUDA step is the graphed one (one process); --eager or another device: the eager step.
        self.graph_step = (config.cuda_graph if config.cuda_graph is not None
                           else self.device.type == "cuda" and not config.ep and not self.has_images)
        if self.graph_step and self.has_images:
            raise ValueError("image-text data trains with the eager step (images differ in size); drop --cuda-graph")
        self.log_every = config.log_every or (10 if self.device.type == "cuda" else 1)
        self.eager_steps = 0  # graphed runs: steps whose batch held more documents than the graph's static count
        self.graphed: GraphedTrainStep | None = None  # captured at the first step (and again on a new row shape)

        from k3.distributed import main_first
        with main_first():  # tokenizer and tokenized data are written once, by rank 0
            self.tokenizer = self._prepare_tokenizer()
            model_config = self._model_config()
            self.model_config = model_config
            self._prepare_data()
            if self.images is not None:
                self.images.prepare(self.out / "data", self.tokenizer, min(n for n, _ in self.stages), self.log)
        if self.dist is not None:
            # Built on the meta device and sharded before any storage exists, so no rank ever holds the whole
            # model; the seeded init gives the same weights under every layout.
            from k3.distributed.init import build_parallel_model
            self.model = build_parallel_model(model_config, self.device, ep_size=config.ep, seed=config.seed,
                                              balanced=config.ep_balanced, qb_aggregate=config.qb_aggregate)
        elif self.images is not None:
            self.model = self.images.build(model_config).to(self.device).language_model
        else:
            self.model = K3ForCausalLM(model_config).to(self.device)
            if config.global_batch:
                # The layout-independent init every torchrun layout uses, so 1 process starts from the same weights.
                from k3.distributed.init import init_weights_seeded
                init_weights_seeded(self.model, config.seed)
        for _, router in self.model.routers():
            router.qb_max_iters = config.qb_iters
            router.aux_loss_coef = config.moe_aux_loss
        if self.bf16_params:  # the model's parameters become bf16, their fp32 values the optimizer's masters
            self.optimizer = MasterWeightAdamW(self.model, config.lr, config.weight_decay)
        else:
            self.optimizer = build_optimizer(self.model, config.lr, config.weight_decay)
        if self.images is not None:
            self.images.add_param_groups(self.optimizer, config.lr, config.weight_decay)
        recall = None
        if config.recall_fraction > 0:
            recall = RecallTask(model_config.vocab_size, num_pairs=config.recall_pairs,
                                num_queries=config.recall_queries or config.recall_pairs)
        self.recall_task = recall
        rank = self.dist.rank if self.dist is not None else 0
        self.stage = 0
        self.train_stream = self._stream_for_stage(0)
        self._check_global_batch()
        self.step = 0
        if self.resume_state is not None:
            self._restore(self.resume_state)
        elif rank == 0:
            _write_json(self.out / "train_config.json", config.to_dict())
            _write_json(self.out / "config.json", model_config.to_dict())
        if self.dist is not None and config.checkpoint_format == "full":
            # Model + AdamW moments, fp32, gathered whole in rank 0's memory at every save.
            gathered_mb = 3 * 4 * sum(p.numel() for p in self.model.parameters()) / 1e6
            self.log(f"checkpoints: full ({CHECKPOINT_NAME}, about {gathered_mb:,.0f} MB gathered on rank 0 per save); "
                     "--checkpoint-format sharded has every rank write its own shards instead")
        self.metrics = MetricsLog(self.out / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"),
                                  keep_through_step=self.step if self.resume_state is not None else None)

    # --- setup -----------------------------------------------------------------------------------
    @property
    def stages(self) -> list[list[int]]:
        """[[seq_len, start_step], ...]: one stage unless a length curriculum was given."""
        return self.config.seq_len_schedule or [[self.config.seq_len, 0]]

    @property
    def seq_len(self) -> int:
        """The current stage's row length."""
        return self.stages[self.stage][0]

    def _stream_for_stage(self, index: int) -> BatchStream:
        """The deterministic batch stream of one stage: its own seed, its row length, its row count."""
        config = self.config
        rank = self.dist.rank if self.dist is not None else 0
        # Stage 0 keeps the seed a run without a schedule has, so such runs are unchanged.
        seed = config.seed + (0 if config.global_batch else rank) + 100_003 * index
        rows = rows_for(self.stages, index, config.batch_size)
        if self.images is not None:  # image rows take their share of the batch
            rows -= self.images.rows_per_step(rows)
        return BatchStream(self.train_tokens, self.stages[index][0], rows,
                           self.tokenizer.eos_token_id, seed=seed, recall=self.recall_task,
                           recall_fraction=config.recall_fraction, recall_length=config.recall_length,
                           recall_weight=config.recall_weight)

    def _check_global_batch(self) -> None:
        if not (self.config.global_batch and self.dist is not None):
            return
        world = self.dist.world_size
        for index, (length, _) in enumerate(self.stages):
            rows = rows_for(self.stages, index, self.config.batch_size)
            if rows % world:
                raise ValueError(f"--global-batch splits every batch over the {world} ranks, but a batch of "
                                 f"{length}-token rows has {rows} rows; give a --batch-size whose rows per stage "
                                 f"divide by {world}")

    def _next_batch(self) -> tuple[PackedBatch, int]:
        """(this rank's packed batch, tokens in the global batch)."""
        if self.images is not None:
            stream = self.train_stream
            text = stream.next_batch() if stream.batch_size else None
            rows = self.images.rows_per_step(rows_for(self.stages, self.stage, self.config.batch_size))
            batch = self.images.batch(text, self.step + 1, rows, self.seq_len, self.tokenizer.eos_token_id)
            return batch, batch.num_tokens
        if not (self.config.global_batch and self.dist is not None):
            batch = self.train_stream.next_batch()
            return batch, batch.num_tokens
        rows = self.train_stream.next_rows()
        share = len(rows) // self.dist.world_size
        mine = rows[self.dist.rank * share:(self.dist.rank + 1) * share]
        return pack_rows(mine, self.tokenizer.eos_token_id), sum(len(r[0]) for r in rows)

    def _global_mean(self, loss: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss whose gradient, averaged over ranks, is the global batch's mean-loss gradient; the global mean
        loss for the log). Ranks score different numbers of tokens (recall rows score only their answers), so a
        mean of the ranks' means would weight tokens unequally."""
        counts = torch.tensor([batch.scored_weight()], dtype=torch.float64, device=self.device)
        local = counts.clone()
        torch.distributed.all_reduce(counts)
        weight = float(local / counts.clamp_min(1.0))
        logged = (loss.detach().double() * weight).reshape(1)
        torch.distributed.all_reduce(logged)
        return loss * (weight * self.dist.world_size), logged[0]

    def _enter_stage_of_next_step(self) -> None:
        index = stage_at(self.stages, self.step)
        if index != self.stage:
            self.stage = index
            self.train_stream = self._stream_for_stage(index)
            self.log(f"step {self.step + 1}: length stage {index + 1}/{len(self.stages)}, {self.seq_len}-token rows, "
                     f"{self.train_stream.batch_size} per step")

    def _corpus(self):
        cap = None if self.config.max_corpus_mb is None else int(self.config.max_corpus_mb * 1e6)
        docs = load_corpus(self.text_data or None, max_bytes=cap)  # image-text files are read apart
        return split_validation(docs, self.config.val_fraction)

    def _prepare_tokenizer(self):
        tokenizer_dir = self.out / "tokenizer"
        if tokenizer_dir.is_dir():
            return load_tokenizer(tokenizer_dir)
        if self.config.tokenizer:
            tokenizer = load_tokenizer(self.config.tokenizer)
        else:
            # A byte-level BPE needs 256 byte ids plus EOS; tiny presets (debug: 256) get a larger table.
            vocab = max(ModelConfig.from_preset(self.config.preset, **self.config.model_overrides).vocab_size, 320)
            train_docs, _ = self._corpus()
            budget = int(self.config.tokenizer_sample_mb * 1e6)
            sample, used = [], 0
            for doc in train_docs:
                if used >= budget:
                    break
                sample.append(doc.text)
                used += len(doc.text)
            self.log(f"training a byte-level BPE (vocab {vocab}) on {used / 1e6:.1f} MB of the corpus")
            tokenizer = train_bpe(sample, vocab, show_progress=self.show_progress)
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; documents cannot be separated. Use a tokenizer "
                             "with an eos_token (tokenizer_config.json) or let k3 train its own BPE")
        tokenizer.save(tokenizer_dir)
        return tokenizer

    def _model_config(self) -> ModelConfig:
        model_config = self._text_model_config()
        if self.has_images:
            from k3.train.images import ImageTraining, vision_config_for
            from k3.vision.config import VisionConfig
            from k3.vision.image_text import media_token_id_for
            if self.resume_state is not None:
                media, vision = self.resume_state["media_token_id"], VisionConfig.from_dict(
                    self.resume_state["vision_config"])
            else:
                media = media_token_id_for(self.tokenizer)
                vision = vision_config_for(self.config.vision, self.config.preset, model_config.hidden_size)
                if media >= model_config.vocab_size:  # the media token is one past the tokenizer's ids
                    model_config = dataclasses.replace(model_config, vocab_size=media + 1)
            self.images = ImageTraining(self.config, self.image_files, media, vision)
        return model_config

    def _text_model_config(self) -> ModelConfig:
        overrides = dict(self.config.model_overrides)
        if self.resume_state is not None:
            return ModelConfig.from_dict(self.resume_state["config"])
        preset_vocab = ModelConfig.from_preset(self.config.preset, **overrides).vocab_size
        if self.tokenizer.vocab_size > preset_vocab:
            # A given tokenizer may be larger than the preset's table: grow the table rather than fail.
            self.log(f"tokenizer has {self.tokenizer.vocab_size} ids; vocab_size raised from {preset_vocab}")
            overrides["vocab_size"] = self.tokenizer.vocab_size
        overrides.setdefault("eos_token_id", self.tokenizer.eos_token_id)
        overrides.setdefault("bos_token_id", self.tokenizer.bos_token_id)
        return ModelConfig.from_preset(self.config.preset, **overrides)

    def _prepare_data(self) -> None:
        data_dir = self.out / "data"
        train_path, val_path = data_dir / "train.bin", data_dir / "val.bin"
        if not (train_path.is_file() and val_path.is_file()):
            train_docs, val_docs = self._corpus()
            eos = self.tokenizer.eos_token_id
            train = tokenize_documents([d.text for d in train_docs], self.tokenizer, eos, self.show_progress)
            val = tokenize_documents([d.text for d in val_docs], self.tokenizer, eos, self.show_progress)
            data_dir.mkdir(parents=True, exist_ok=True)
            save_stream(train_path, train)
            save_stream(val_path, val)
            self.log(f"corpus: {len(train_docs)} train documents ({len(train):,} tokens), {len(val_docs)} "
                     f"validation documents ({len(val):,} tokens)")
        self.train_tokens, self.val_tokens = load_stream(train_path), load_stream(val_path)
        longest = max(n for n, _ in self.stages)
        if len(self.val_tokens) < longest + 1:
            raise ValueError(f"the validation split has {len(self.val_tokens)} tokens, fewer than one row of "
                             f"{longest} tokens (the longest stage); use more data, a larger val_fraction or a "
                             f"shorter --seq-len")

    def _restore(self, state: dict[str, Any]) -> None:
        if state["saved_format"] == "sharded":
            # DCP reshards: the saved layout (1 process, FSDP, any EP) need not be this one.
            from k3.distributed.sharded_checkpoint import load_sharded
            load_sharded(checkpoint_path(self.out, "sharded"), self.model, self.optimizer)
        elif self.dist is None:
            load_model_state(self.model, state["model"], str(self.out / CHECKPOINT_NAME))
            if self.bf16_params:
                self.optimizer.load_masters(self.model, state["model"])
            if self.images is not None:
                self.images.load_checkpoint_state(state, str(self.out / CHECKPOINT_NAME))
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            # Every rank read the whole checkpoint and keeps its own shards. The data streams are per rank
            # (seed + rank) and advance alike, so rank 0's position is every rank's: with the same number of
            # ranks the resumed run continues exactly; with another number it continues on other rows.
            from k3.distributed.checkpoint import load_full_optimizer_state_dict, load_full_state_dict
            load_full_state_dict(self.model, state["model"])
            load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.step = int(state["step"])
        self.stage = int(state["data"].get("stage", 0))
        self.train_stream = self._stream_for_stage(self.stage)
        per_rank = state.get("data_per_rank")
        if self.config.global_batch:
            # One global stream, at the same position on every rank: any layout continues it.
            self.train_stream.load_state_dict(state["data"])
        elif self.dist is not None and per_rank is not None and len(per_rank) == self.dist.world_size:
            self.train_stream.load_state_dict(per_rank[self.dist.rank])
        else:
            if self.dist is not None or per_rank is not None:
                self.log(f"resuming on {self.dist.world_size if self.dist else 1} rank(s) a run saved on "
                         f"{len(per_rank) if per_rank else 1}: model and optimizer continue exactly, the data "
                         "rows differ from an unbroken run's")
            self.train_stream.load_state_dict(state["data"])
        _set_rng_state(state["rng"])

    # --- pieces of the loop ----------------------------------------------------------------------
    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        ids = batch.input_ids.to(self.device)
        labels = batch.labels.to(self.device)
        cu = batch.cu_seqlens.to(self.device)
        if self.images is not None and self.images.split is not None:
            self.images.split.start()
        with self._autocast():
            embeds = None
            if batch.pixel_values is not None:  # image-text rows: the images' embeddings at the media tokens
                ids, embeds = None, self.images.embed(ids, batch)
            if batch.weights is None:
                loss = self.model(ids, cu_seqlens=cu, labels=labels, return_logits=False, inputs_embeds=embeds).loss
            else:
                loss = weighted_loss(self.model(ids, cu_seqlens=cu, inputs_embeds=embeds).logits, labels,
                                     batch.weights.to(self.device))
        return self._plus_aux_loss(self.model, loss)

    def max_documents(self, rows: int | None = None) -> int:
        """The graphed step's static document count: per row times the rows of a batch."""
        per_row = self.config.max_documents_per_row or max(16, self.seq_len // 128)
        return per_row * (rows if rows is not None else self.train_stream.batch_size)

    def _rows_loss(self, model: K3ForCausalLM, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of [B, T] rows, their documents kept apart by the padded cu_seqlens (static shapes, no host
        sync): what the CUDA graph captures. Without "cu_seqlens", the rows as plain sequences."""
        ids, labels, weights = rows["ids"], rows["labels"], rows.get("weights")
        packing = {}
        if "cu_seqlens" in rows:
            packing = dict(cu_seqlens=rows["cu_seqlens"], max_documents=rows["cu_seqlens"].shape[0] - 1,
                           row_length=ids.shape[1])
            ids, labels = ids.reshape(1, -1), labels.reshape(1, -1)
            weights = weights.reshape(1, -1) if weights is not None else None
        with self._autocast():
            if weights is not None:
                loss = weighted_loss(model(ids, **packing).logits, labels, weights)
            else:
                loss = model(ids, labels=labels, return_logits=False, **packing).loss
        return self._plus_aux_loss(model, loss)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                              enabled=self.autocast is not None)

    def _plus_aux_loss(self, model: K3ForCausalLM, loss: torch.Tensor) -> torch.Tensor:
        """The routers' auxiliary balance loss added in training (--moe-aux-loss > 0)."""
        if self.config.moe_aux_loss > 0 and model.training:
            aux = [r.aux_loss for _, r in model.routers() if r.aux_loss is not None]
            if aux:
                loss = loss + torch.stack(aux).sum()
        return loss

    def _rows(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """A packed batch as [rows, seq_len] tensors on the device (ids, labels, and weights when the run has
        weighted rows: then every batch carries them, ones where it has none, so one graph serves all)."""
        shape = (batch.num_tokens // self.seq_len, self.seq_len)
        rows = {"ids": batch.input_ids.view(shape), "labels": batch.labels.view(shape),
                "cu_seqlens": pad_cu_seqlens(batch.cu_seqlens, self.max_documents(shape[0]))}
        if self.config.recall_fraction > 0:
            rows["weights"] = (batch.weights.view(shape) if batch.weights is not None
                               else torch.ones(shape, dtype=torch.float32))
        return {name: t.to(self.device, non_blocking=True) for name, t in rows.items()}

    def _graphed_step(self, batch: PackedBatch) -> torch.Tensor:
        """Forward and backward of `batch` as [batch rows, seq_len] rows with its documents apart, replayed from
        the CUDA graph; the parameters' .grad are set. Returns the loss."""
        rows = self._rows(batch)
        shape = tuple(rows["ids"].shape)
        if self.graphed is None or self.graphed.static["ids"].shape != shape:
            self.graphed = None  # a new row shape (a length-curriculum stage): free the old graph first
            torch.cuda.empty_cache()
            self.graphed = GraphedTrainStep(self.model, self._rows_loss, rows,
                                            qb_updates=min(self.config.qb_iters, QB_GRAPH_UPDATES) or None)
        return self.graphed(rows)

    @kernels_applied
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first eval_batches * batch_size rows of the validation stream (fixed rows)."""
        self.model.eval()
        rows_per_batch = self.train_stream.batch_size or self.config.batch_size  # 0 text rows: image-only steps
        seq_len = self.seq_len  # the current stage's length
        num_rows = (len(self.val_tokens) - 1) // seq_len
        total, count = 0.0, 0
        for b in range(self.config.eval_batches):
            indices = [(b * rows_per_batch + r) % num_rows for r in range(rows_per_batch)]
            batch = pack_rows([text_row(self.val_tokens, i, seq_len, self.tokenizer.eos_token_id)
                               for i in indices], self.tokenizer.eos_token_id)
            scored = int((batch.labels != -100).sum())
            total += float(self._forward(batch)) * scored
            count += scored
        self.model.train()
        return total / max(count, 1)

    @kernels_applied
    @torch.no_grad()
    def evaluate_images(self) -> float:
        """Mean loss over fixed batches of the held-out image-text examples."""
        self.model.eval()
        rows = self.images.rows_per_step(rows_for(self.stages, self.stage, self.config.batch_size))
        total, count = 0.0, 0
        for batch in self.images.validation_batches(self.config.eval_batches, rows, self.seq_len,
                                                    self.tokenizer.eos_token_id):
            scored = int((batch.labels != -100).sum())
            total += float(self._forward(batch)) * scored
            count += scored
        self.model.train()
        return total / max(count, 1)

    def save(self) -> None:
        if self.config.checkpoint_format == "sharded":
            self._save_sharded()
        else:
            self._save_full()
        # One kind of checkpoint per run: a resume must not find an older one of the other kind.
        if self.dist is None or self.dist.rank == 0:
            other = checkpoint_path(self.out, "full" if self.config.checkpoint_format == "sharded" else "sharded")
            if other.is_dir():
                shutil.rmtree(other)
            elif other.exists():
                other.unlink()

    def _run_state(self) -> dict[str, Any]:
        """Everything of a checkpoint but the model, optimizer and tokenizer."""
        return {"config": self.model_config.to_dict(), "train": self.config.to_dict(), "step": self.step,
                "data": {**self.train_stream.state_dict(), "stage": self.stage}}

    def _data_per_rank(self) -> list[dict] | None:
        """Each rank reads its own data stream (its recall rows differ), so every rank's position is kept."""
        if self.dist is None:
            return None
        data_per_rank = [None] * self.dist.world_size
        torch.distributed.all_gather_object(data_per_rank, {**self.train_stream.state_dict(), "stage": self.stage})
        return data_per_rank

    def _save_sharded(self) -> None:
        from k3.distributed.sharded_checkpoint import save_sharded

        extra = {**self._run_state(), "rng": _rng_state()}
        data_per_rank = self._data_per_rank()
        if data_per_rank is not None:
            extra["data_per_rank"] = data_per_rank
        save_sharded(checkpoint_path(self.out, "sharded"), self.model, self.optimizer, extra=extra)

    def _save_full(self) -> None:
        if self.dist is None:
            model_state = (self.optimizer.model_state_dict(self.model) if self.bf16_params
                           else self.model.state_dict())
            optimizer_state = self.optimizer.state_dict()
        else:
            # Full (single-device) state gathered on rank 0: the checkpoint loads and resumes without --ep too.
            from k3.distributed import barrier, full_state_dict
            from k3.distributed.checkpoint import full_optimizer_state_dict
            model_state = full_state_dict(self.model)
            optimizer_state = full_optimizer_state_dict(self.model, self.optimizer)
            data_per_rank = self._data_per_rank()
            if self.dist.rank != 0:
                barrier()
                return
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            **(self.images.checkpoint_state() if self.images is not None else {}),
            **self._run_state(),
            **({"data_per_rank": data_per_rank} if self.dist is not None else {}),
            "rng": _rng_state(),
            "tokenizer": directory_files(self.out / "tokenizer"),
        }
        save_checkpoint(self.out / CHECKPOINT_NAME, state)
        if self.dist is not None:
            from k3.distributed import barrier
            barrier()

    def plot(self) -> None:
        if self.dist is not None and self.dist.rank != 0:
            return
        plot_metrics(self.out / "metrics.jsonl", self.out / "metrics.png")

    # --- the loop --------------------------------------------------------------------------------
    @kernels_applied
    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train up to max_steps (or stop after step `stop_at`, as an interrupted run would; the schedule still
        spans max_steps). Returns a summary: steps, first/last val loss, tokens/s, why it stopped."""
        config = self.config
        self.model.train()
        summary: dict[str, Any] = {"start_step": self.step, "stopped": "max_steps"}
        if self.step == 0:
            first_val = self.evaluate()
            self.metrics.write({"step": 0, "val_loss": first_val})
            summary["first_val_loss"] = first_val
            self.log(f"step 0: val_loss {first_val:.4f}")
        started = time.perf_counter()
        tokens_seen = 0
        bar = tqdm(total=config.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not self.show_progress, dynamic_ncols=True)
        profiler = None
        if self.profile_dir is not None:
            first = self.step + PROFILE_AFTER + 1 if self.profile_at is None else self.profile_at
            if first <= self.step:
                raise ValueError(f"--profile-at {first}: this run resumes after step {self.step}; profile a later step")
            profiler = StepProfiler(self.profile_dir, first, self.device, vision=self.images is not None)
            if self.images is not None:
                self.images.split = profiler.vision_split  # the tower's share of the profiled steps
            if profiler.first > config.max_steps:
                why = (f"it skips the first {PROFILE_AFTER} steps, which compile kernels" if self.profile_at is None
                       else "--profile-at")
                self.log(f"--profile: the run ends before step {profiler.first}, where the profile would start "
                         f"({why}); nothing profiled")
        pending: list[tuple[dict[str, Any], torch.Tensor]] = []  # steps whose device values are not read yet
        window_started = time.perf_counter()
        try:
            while self.step < config.max_steps:
                if stop_at is not None and self.step >= stop_at:
                    summary["stopped"] = "stop_at"
                    break
                if config.time_budget_s is not None and time.perf_counter() - started > config.time_budget_s:
                    summary["stopped"] = "time_budget"
                    break
                if "first_step_s" not in summary and self.device.type == "cuda":
                    # On a GPU the first step compiles its kernels (Triton, fla, Inductor): minutes on a cold
                    # kernel cache, with nothing else to show that the run is alive.
                    bar.set_postfix_str("first step: compiling GPU kernels (minutes on a cold kernel cache)")
                    bar.refresh()
                if profiler is not None:
                    profiler.before(self.step + 1)
                pending.append(self._train_step())
                tokens_seen += pending[-1][0]["tokens"]
                bar.update(1)
                eval_due = self.step % config.eval_every == 0 or self.step == config.max_steps
                save_due = self.step % config.save_every == 0 or self.step == config.max_steps
                # Read the window: at its end, at the session's first step (its time is the compile's), before an
                # eval or a save (a non-finite loss must stop the run before it reaches a checkpoint), in a
                # profiled run, and where the loop will stop.
                if not (self.step % self.log_every == 0 or "first_step_s" not in summary or eval_due or save_due
                        or profiler is not None or (stop_at is not None and self.step >= stop_at)
                        or (config.time_budget_s is not None
                            and time.perf_counter() - started > config.time_budget_s)):
                    continue
                records = self._read_window(pending, time.perf_counter() - window_started)
                pending = []
                if profiler is not None:
                    profiler.after(self.step, records[-1]["step_seconds"])
                    if self.step == profiler.last:
                        self.log(f"profile of steps {profiler.first}-{self.step} written to {profiler.written}")
                if "first_step_s" not in summary:
                    summary["first_step_s"] = records[0]["step_seconds"]
                    if self.device.type == "cuda":
                        self.log(f"first step took {records[0]['step_seconds']:.1f} s (kernel compiles included)")
                if eval_due:
                    records[-1]["val_loss"] = self.evaluate()
                    summary["last_val_loss"] = records[-1]["val_loss"]
                    if self.images is not None and self.images.val_examples:
                        records[-1]["val_image_loss"] = summary["last_val_image_loss"] = self.evaluate_images()
                for record in records:
                    self.metrics.write(record)
                bar.set_postfix(loss=f"{records[-1]['loss']:.3f}", tok_s=f"{records[-1]['tokens_per_s']:.0f}")
                if save_due:
                    self.save()
                window_started = time.perf_counter()
            if pending:  # stopped between reads
                for record in self._read_window(pending, time.perf_counter() - window_started):
                    self.metrics.write(record)
        finally:
            bar.close()
            if profiler is not None:
                profiler.close()  # stopped inside the window: what was profiled is still written
        if profiler is not None and profiler.written is not None:
            summary["profile"] = str(profiler.written)
        elapsed = time.perf_counter() - started
        if summary["stopped"] == "time_budget":
            summary["last_val_loss"] = self.evaluate()
            self.metrics.write({"step": self.step, "val_loss": summary["last_val_loss"]})
            self.save()
        summary.update(steps=self.step, train_seconds=elapsed,
                       tokens_per_s=tokens_seen / elapsed if elapsed > 0 else 0.0)
        if self.images is not None:
            summary["image_examples"] = len(self.images.train_examples)
            summary["skipped_image_records"] = len(self.images.skipped)
            if self.images.skipped:
                self.log(f"{len(self.images.skipped)} bad image-text record(s) were skipped (--skip-bad-images), "
                         f"e.g. {self.images.skipped[0]}")
        self.plot()
        return summary

    def _train_step(self) -> tuple[dict[str, Any], torch.Tensor]:
        """One optimizer step, with no host sync of its own: (the step's host-side metrics, its device-side values
        as one float64 vector: loss, grad norm, maxvio per MoE layer, device-counted QB updates), which
        _read_window turns into the metrics record."""
        config = self.config
        lr = lr_at(self.step, config.max_steps, config.lr, config.warmup_steps, config.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # vision groups: --vision-lr / --lr
        self._enter_stage_of_next_step()
        t0 = time.perf_counter()
        batch, global_tokens = self._next_batch()
        graphed = self.graph_step and batch.cu_seqlens.numel() - 1 <= self.max_documents(
            batch.num_tokens // self.seq_len)
        if graphed:  # forward and backward in one replay
            loss = logged_loss = self._graphed_step(batch)
        else:
            self.eager_steps += self.graph_step  # too many documents for the graph's static count
            loss = self._forward(batch)
            logged_loss = loss.detach()
        if self.config.global_batch and self.dist is not None:
            loss, logged_loss = self._global_mean(loss, batch)
        if not graphed:
            loss.backward()
            if self.images is not None and self.images.split is not None:
                self.images.split.backward_done()
        # bf16 parameters: their gradients are clipped in fp32, as the masters' gradients (no images then).
        trained = (self.optimizer.take_grads() if self.bf16_params else
                   [*self.model.parameters(), *(self.images.trained_parameters() if self.images is not None else [])])
        grad_norm = clip_grad_norm_(trained, config.grad_clip)  # any parallel layout
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.update_balancers()
        self.step += 1
        # Copies, not views: a graph replay overwrites the routers' tensors at the next step.
        layers = [(i, router.last_load_E) for i, router in self.model.routers() if router.last_load_E is not None]
        qb_updates = [router.last_qb_iters for _, router in self.model.routers()]
        values = [logged_loss.reshape(()), torch.as_tensor(grad_norm).reshape(()),
                  *(device_maxvio(load) for _, load in layers),
                  *(q.reshape(()) for q in qb_updates if isinstance(q, torch.Tensor))]
        device_values = torch.stack([v.to(self.device, torch.float64) for v in values])
        host = {
            "step": self.step,
            "lr": lr,
            "tokens": global_tokens,
            "host_seconds": time.perf_counter() - t0,
            "layers": [i for i, _ in layers],
            "qb_updates": [None if isinstance(q, torch.Tensor) else int(q) for q in qb_updates],  # None: on the device
            # Packed documents in this rank's batch: the full-attention layers run one SDPA call per document.
            "documents": int(batch.cu_seqlens.numel()) - 1,
            "graphed": graphed,
            "epoch": round(self.train_stream.epoch, 4),
            "seq_len": self.seq_len,
        }
        if batch.grid_thw is not None:  # image-text rows: the images and their 14-px patches in this step
            host["images"] = int(batch.grid_thw.shape[0])
            host["image_patches"] = int(batch.grid_thw.prod(-1).sum())
        return host, device_values

    def _read_window(self, pending: list[tuple[dict[str, Any], torch.Tensor]], seconds: float) -> list[dict[str, Any]]:
        """The metrics records of the steps in `pending`, their device values read in one host sync; each step's
        time is the window's mean (`seconds` over its steps). A non-finite loss writes that step's record and
        raises: the steps before it are written, and the run stops before its next save."""
        # One copy to the host; steps' vectors may differ in length (an eager step's QB counts are host ints).
        flat = torch.cat([v for _, v in pending]).cpu().tolist()
        values, start = [], 0
        for _, v in pending:
            values.append(flat[start:start + v.numel()])
            start += v.numel()
        step_seconds = seconds / len(pending)
        tokens = sum(host["tokens"] for host, _ in pending)
        records = []
        for (host, _), row in zip(pending, values):
            loss, grad_norm, rest = row[0], row[1], row[2:]
            maxvio_values, device_qb = rest[:len(host["layers"])], iter(rest[len(host["layers"]):])
            qb_updates = [int(q) if q is not None else int(next(device_qb)) for q in host["qb_updates"]]
            if not math.isfinite(loss):  # global under --global-batch: every rank stops together
                # Nothing from this step reaches the checkpoint: the last good one stays on disk.
                for record in records:
                    self.metrics.write(record)
                self.metrics.write({"step": host["step"], "loss": loss, "lr": host["lr"]})
                self.plot()
                raise NonFiniteLossError(
                    f"loss became {loss} at step {host['step']}; training stopped and the last good checkpoint "
                    f"({self.out / CHECKPOINT_NAME}, step {self._saved_step()}) was kept. Lower --lr, raise "
                    f"--warmup-steps or check the data, then continue with --resume")
            records.append({
                "step": host["step"],
                "loss": loss,
                "lr": host["lr"],
                "grad_norm": grad_norm,
                "tokens": host["tokens"],
                "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                # The window's mean; the first step of a session includes kernel compiles (and a graph capture).
                "step_seconds": round(step_seconds, 4),
                "maxvio": max(maxvio_values) if maxvio_values else 0.0,
                "maxvio_per_layer": {str(i): round(v, 4) for i, v in zip(host["layers"], maxvio_values)},
                # The published QB takes one update per MoE layer and step; the iterated one, up to --qb-iters.
                "qb_updates_max": max(qb_updates, default=0),
                "qb_updates_mean": round(sum(qb_updates) / len(qb_updates), 2) if qb_updates else 0.0,
                "documents": host["documents"],
                "graphed": host["graphed"],
                "epoch": host["epoch"],
                "seq_len": host["seq_len"],
                **({"window_steps": len(pending)} if len(pending) > 1 else {}),
                **{key: host[key] for key in ("images", "image_patches") if key in host},
            })
        return records

    def _saved_step(self) -> int | str:
        found = saved_format(self.out)
        if found is None:
            return "none yet"
        try:
            if found == "sharded":
                from k3.distributed.sharded_checkpoint import read_sharded_extra
                return int(read_sharded_extra(checkpoint_path(self.out, "sharded"))["step"])
            return int(load_checkpoint(self.out / CHECKPOINT_NAME)["step"])
        except (RuntimeError, ValueError, OSError):
            return "unreadable"


def train(config: TrainConfig, resume: bool = False, **kwargs: Any) -> dict[str, Any]:
    """Build a Trainer and run it; see Trainer.train for the summary."""
    return Trainer(config, resume=resume, **kwargs).train()
