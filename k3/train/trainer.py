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
(k3.train.run_dir keeps the directory, k3.train.loop runs the loop; this module supplies the step.)
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from k3.checkpoint.native import CHECKPOINT_NAME, load_model_state
from k3.checkpoint.run import checkpoint_path
from k3.config import ModelConfig
from k3.runtime import autocast_dtype, resolve_device
from k3.runtime import rng_state, set_rng_state
from k3.data.corpus import load_corpus, split_validation
from k3.data.packing import BatchStream, PackedBatch, load_stream, save_stream, text_row, pack_rows, \
    tokenize_documents
from k3.data.synthetic import RecallTask
from k3.data.tokenizer import load_tokenizer, train_bpe
from k3.distributed.loop import clip_grad_norm_
from k3.kernels import applied as kernels_applied
from k3.model import K3ForCausalLM, pad_cu_seqlens
from k3.train.graphed_step import QB_GRAPH_UPDATES, GraphedTrainStep
from k3.train.config import TrainConfig
from k3.train.master_weights import MasterWeightAdamW
from k3.train.loop import Cadence, LoopHooks, TrainingLoop
from k3.train.metrics import plot_metrics
from k3.train.optim import build_optimizer, lr_at
from k3.train.profile import PROFILE_AFTER, StepProfiler
from k3.train.run_dir import RunDirectory, RunKind
from k3.train.schedule import rows_for, stage_at



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


RUN = RunKind(key="train", settings_file="train_config.json", command="k3 train", what="a run", sharded=True)


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
        self._compile_logged = False  # the first step's compile time logged (CUDA)
        self.show_progress = show_progress
        self.out = Path(config.out)
        self.run_dir = RunDirectory(self.out, RUN)
        # A sharded checkpoint's model and optimizer shards load later, into the parallel layout.
        self.resume_state = self.run_dir.open(resume)
        if resume:
            saved = TrainConfig.from_dict(self.resume_state["train"])  # a sectioned or an older flat layout
            # Data, model and optimizer settings must stay as they were, or the resumed run would diverge from
            # the unbroken one; out may move with the run directory.
            # The parallel layout is not part of the run: a resume is single-process unless --ep (and
            # --ep-balanced) are given again.
            config = saved.replace(out=config.out, **{"ep": 0, "ep_balanced": False, **(resume_overrides or {})})
        else:
            # Left by an attempt that stopped before its first checkpoint: made from possibly other settings.
            self.run_dir.check_new(leftovers=("tokenizer", "data"))
        self.config = config
        from k3.train.images import split_data_files
        # A resumed run reads its data from DIR/data (kept at the first run), not from the --data files.
        self.text_data, self.image_files = split_data_files(config.data.data) if not resume else (config.data.data, [])
        self.has_images = bool(self.image_files) if not resume else "vision" in self.resume_state
        self.images = None  # k3.train.images.ImageTraining when --data holds image-text files
        if not resume:
            self.run_dir.create()
        torch.manual_seed(config.seed)
        np.random.seed(config.seed)
        random.seed(config.seed)
        self.device = resolve_device(config.device)
        self.dist = None
        if config.parallel.ep:
            # Distributed run (k3.distributed): every rank trains its own data rows; rank 0 logs and saves.
            from k3.distributed import check_ep_size, init_distributed
            self.dist = init_distributed(device=None if config.device == "auto" else config.device)
            self.device = self.dist.device
            # Before the data is prepared: a bad --ep fails at once.
            check_ep_size(config.parallel.ep, self.dist.world_size,
                          ModelConfig.from_preset(config.preset, **config.model_overrides).num_experts)
            if self.dist.rank != 0:
                self.log, self.show_progress = (lambda *_: None), False
        self.autocast = autocast_dtype(config.dtype, self.device)
        self.bf16_params = config.optim.master_weights == "bf16-params" or (
            config.optim.master_weights == "auto" and self.autocast == torch.bfloat16 and self.device.type == "cuda"
            and not config.parallel.ep and config.checkpoint.format == "full" and not self.has_images)
        if self.bf16_params and self.has_images:
            raise ValueError("image-text data trains with fp32 weights under autocast; drop --master-weights bf16-params")
        if self.bf16_params:
            self.autocast = None  # the parameters are bf16: nothing to cast
        if config.cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a CUDA device; this run is on {self.device} (drop --cuda-graph)")
        # The default CUDA step is the graphed one (one process); --eager or another device: the eager step.
        self.graph_step = (config.cuda_graph if config.cuda_graph is not None
                           else self.device.type == "cuda" and not config.parallel.ep and not self.has_images)
        if self.graph_step and self.has_images:
            raise ValueError("image-text data trains with the eager step (images differ in size); drop --cuda-graph")
        # Image-text steps on a GPU hand the language model its documents in the static form (cu_seqlens padded to
        # max_documents, attention masked within rows): no host read of cu_seqlens and no per-document attention
        # calls, which at ~30 short examples a row made the eager step launch-bound. The CPU keeps the
        # per-document form (it costs sum(len^2), not rows x row_length^2, of attention).
        self.static_image_documents = self.device.type == "cuda"
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
            parallel = config.parallel
            self.model = build_parallel_model(model_config, self.device, ep_size=parallel.ep, seed=config.seed,
                                              balanced=parallel.ep_balanced, qb_aggregate=parallel.qb_aggregate)
        elif self.images is not None:
            self.model = self.images.build(model_config).to(self.device).language_model
        else:
            self.model = K3ForCausalLM(model_config).to(self.device)
            if config.parallel.global_batch:
                # The layout-independent init every torchrun layout uses, so 1 process starts from the same weights.
                from k3.distributed.init import init_weights_seeded
                init_weights_seeded(self.model, config.seed)
        for _, router in self.model.routers():
            router.qb_max_iters = config.optim.qb_iters
            router.aux_loss_coef = config.optim.moe_aux_loss
        if self.bf16_params:  # the model's parameters become bf16, their fp32 values the optimizer's masters
            self.optimizer = MasterWeightAdamW(self.model, config.optim.lr, config.optim.weight_decay)
        else:
            self.optimizer = build_optimizer(self.model, config.optim.lr, config.optim.weight_decay)
        if self.images is not None:
            self.images.add_param_groups(self.optimizer, config.optim.lr, config.optim.weight_decay)
        recall = None
        if config.recall.fraction > 0:
            recall = RecallTask(model_config.vocab_size, num_pairs=config.recall.pairs,
                                num_queries=config.recall.queries or config.recall.pairs)
        self.recall_task = recall
        rank = self.dist.rank if self.dist is not None else 0
        self.stage = 0
        self.train_stream = self._stream_for_stage(0)
        self._check_global_batch()
        self.step = 0
        if self.resume_state is not None:
            self._restore(self.resume_state)
        elif rank == 0:
            self.run_dir.write_settings(config.to_dict(), model_config.to_dict())
        if self.dist is not None and config.checkpoint.format == "full":
            # Model + AdamW moments, fp32, gathered whole in rank 0's memory at every save.
            gathered_mb = 3 * 4 * sum(p.numel() for p in self.model.parameters()) / 1e6
            self.log(f"checkpoints: full ({CHECKPOINT_NAME}, about {gathered_mb:,.0f} MB gathered on rank 0 per save); "
                     "--checkpoint-format sharded has every rank write its own shards instead")
        self.metrics = self.run_dir.metrics(self.step, resumed=self.resume_state is not None, rank=rank)

    # --- setup -----------------------------------------------------------------------------------
    @property
    def stages(self) -> list[list[int]]:
        """[[seq_len, start_step], ...]: one stage unless a length curriculum was given."""
        return self.config.data.seq_len_schedule or [[self.config.data.seq_len, 0]]

    @property
    def seq_len(self) -> int:
        """The current stage's row length."""
        return self.stages[self.stage][0]

    def _stream_for_stage(self, index: int) -> BatchStream:
        """The deterministic batch stream of one stage: its own seed, its row length, its row count."""
        config = self.config
        rank = self.dist.rank if self.dist is not None else 0
        # Stage 0 keeps the seed a run without a schedule has, so such runs are unchanged.
        seed = config.seed + (0 if config.parallel.global_batch else rank) + 100_003 * index
        rows = rows_for(self.stages, index, config.data.batch_size)
        if self.images is not None:  # image rows take their share of the batch
            rows -= self.images.rows_per_step(rows)
        return BatchStream(self.train_tokens, self.stages[index][0], rows,
                           self.tokenizer.eos_token_id, seed=seed, recall=self.recall_task,
                           recall_fraction=config.recall.fraction, recall_length=config.recall.length,
                           recall_weight=config.recall.weight)

    def _check_global_batch(self) -> None:
        if not (self.config.parallel.global_batch and self.dist is not None):
            return
        world = self.dist.world_size
        for index, (length, _) in enumerate(self.stages):
            rows = rows_for(self.stages, index, self.config.data.batch_size)
            if rows % world:
                raise ValueError(f"--global-batch splits every batch over the {world} ranks, but a batch of "
                                 f"{length}-token rows has {rows} rows; give a --batch-size whose rows per stage "
                                 f"divide by {world}")

    def _next_batch(self) -> tuple[PackedBatch, int]:
        """(this rank's packed batch, tokens in the global batch)."""
        if self.images is not None:
            stream = self.train_stream
            text = stream.next_batch() if stream.batch_size else None
            rows = self.images.rows_per_step(rows_for(self.stages, self.stage, self.config.data.batch_size))
            batch = self.images.batch(text, self.step + 1, rows, self.seq_len, self.tokenizer.eos_token_id)
            return batch, batch.num_tokens
        if not (self.config.parallel.global_batch and self.dist is not None):
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
        cap = None if self.config.data.max_corpus_mb is None else int(self.config.data.max_corpus_mb * 1e6)
        docs = load_corpus(self.text_data or None, max_bytes=cap)  # image-text files are read apart
        return split_validation(docs, self.config.data.val_fraction)

    def _prepare_tokenizer(self):
        tokenizer_dir = self.out / "tokenizer"
        if tokenizer_dir.is_dir():
            return load_tokenizer(tokenizer_dir)
        if self.config.data.tokenizer:
            tokenizer = load_tokenizer(self.config.data.tokenizer)
        else:
            # A byte-level BPE needs 256 byte ids plus EOS; tiny presets (debug: 256) get a larger table.
            vocab = max(ModelConfig.from_preset(self.config.preset, **self.config.model_overrides).vocab_size, 320)
            train_docs, _ = self._corpus()
            budget = int(self.config.data.tokenizer_sample_mb * 1e6)
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
                vision = vision_config_for(self.config.images.vision, self.config.preset, model_config.hidden_size)
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
        if self.config.parallel.global_batch:
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
        set_rng_state(state["rng"])

    # --- pieces of the loop ----------------------------------------------------------------------
    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        ids = batch.input_ids.to(self.device)
        labels = batch.labels.to(self.device)
        cu, packing = batch.cu_seqlens, {}
        if batch.image_patches is not None and self.static_image_documents:
            limit = self.max_documents(batch.num_tokens // self.seq_len)
            if cu.numel() - 1 <= limit:  # rows hold whole documents (examples and filler): the static form fits
                cu, packing = pad_cu_seqlens(cu, limit), dict(max_documents=limit, row_length=self.seq_len)
        cu = cu.to(self.device)
        if self.images is not None and self.images.split is not None:
            self.images.split.start()
        with self._autocast():
            embeds = None
            if batch.image_patches is not None:  # image-text rows: the images' embeddings at the media tokens
                ids, embeds = None, self.images.embed(ids, batch)
            if batch.weights is None:
                loss = self.model(ids, cu_seqlens=cu, labels=labels, return_logits=False, inputs_embeds=embeds,
                                  **packing).loss
            else:
                loss = weighted_loss(self.model(ids, cu_seqlens=cu, inputs_embeds=embeds, **packing).logits, labels,
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
        if self.config.optim.moe_aux_loss > 0 and model.training:
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
        if self.config.recall.fraction > 0:
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
                                            qb_updates=min(self.config.optim.qb_iters, QB_GRAPH_UPDATES) or None)
        return self.graphed(rows)

    @kernels_applied
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first eval_batches * batch_size rows of the validation stream (fixed rows)."""
        self.model.eval()
        rows_per_batch = self.train_stream.batch_size or self.config.data.batch_size  # 0 text rows: image-only steps
        seq_len = self.seq_len  # the current stage's length
        num_rows = (len(self.val_tokens) - 1) // seq_len
        total, count = 0.0, 0
        for b in range(self.config.eval.batches):
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
        rows = self.images.rows_per_step(rows_for(self.stages, self.stage, self.config.data.batch_size))
        total, count = 0.0, 0
        for batch in self.images.validation_batches(self.config.eval.batches, rows, self.seq_len,
                                                    self.tokenizer.eos_token_id):
            scored = int((batch.labels != -100).sum())
            total += float(self._forward(batch)) * scored
            count += scored
        self.model.train()
        return total / max(count, 1)

    def save(self) -> None:
        """The run's checkpoint (collective under torchrun); the older one of the other format goes."""
        if self.config.checkpoint.format == "sharded":
            self._save_sharded()
        else:
            self._save_full()

    def _data_state(self) -> dict[str, Any]:
        """Where the data stream stands: what a resumed run continues from."""
        return {**self.train_stream.state_dict(), "stage": self.stage}

    def _run_state(self) -> dict[str, Any]:
        """Everything of a checkpoint but the model, optimizer and tokenizer."""
        return {"config": self.model_config.to_dict(), "train": self.config.to_dict(), "step": self.step,
                "data": self._data_state()}

    def _data_per_rank(self) -> list[dict] | None:
        """Each rank reads its own data stream (its recall rows differ), so every rank's position is kept."""
        if self.dist is None:
            return None
        data_per_rank = [None] * self.dist.world_size
        torch.distributed.all_gather_object(data_per_rank, self._data_state())
        return data_per_rank

    def _save_sharded(self) -> None:
        from k3.distributed.sharded_checkpoint import save_sharded

        extra = {**self._run_state(), "rng": rng_state()}
        data_per_rank = self._data_per_rank()
        if data_per_rank is not None:
            extra["data_per_rank"] = data_per_rank
        save_sharded(checkpoint_path(self.out, "sharded"), self.model, self.optimizer, extra=extra)
        if self.dist is None or self.dist.rank == 0:
            self.run_dir.remove_other_format("sharded")

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
        extra = {**(self.images.checkpoint_state() if self.images is not None else {}),
                 "data": self._data_state(),
                 **({"data_per_rank": data_per_rank} if self.dist is not None else {})}
        self.run_dir.save(model_state, optimizer_state, self.model_config.to_dict(), self.config.to_dict(), self.step,
                          extra)
        if self.dist is not None:
            from k3.distributed import barrier
            barrier()

    def plot(self) -> None:
        if self.dist is not None and self.dist.rank != 0:
            return
        plot_metrics(self.out / "metrics.jsonl", self.out / "metrics.png")

    # --- the loop (k3.train.loop runs it) ----------------------------------------------------------
    @kernels_applied
    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train up to max_steps (or stop after step `stop_at`, as an interrupted run would; the schedule still
        spans max_steps). Returns a summary: steps, first/last val loss, tokens/s, why it stopped."""
        config = self.config
        self.model.train()
        self._profiler = self._step_profiler()
        self._tokens_seen, self._first_step_s = 0, None
        compiles = "first step: compiling GPU kernels (minutes on a cold kernel cache)"
        loop = TrainingLoop(
            # A profiled run reads every step: the profiler takes each step's time.
            Cadence(config.max_steps, config.checkpoint.every, config.eval.every,
                    1 if self._profiler is not None else self.log_every),
            LoopHooks(step=self._loop_step, position=lambda: self.step, save=self.save, read=self._loop_read,
                      evaluate=self._evaluations, plot=self.plot,
                      describe_first_eval=lambda values: [f"val_loss {values['val_loss']:.4f}"],
                      progress=lambda r: {"loss": f"{r['loss']:.3f}", "tok_s": f"{r['tokens_per_s']:.0f}"}),
            metrics=self.metrics, desc="train", show_progress=self.show_progress, log=self.log,
            time_budget_s=config.time_budget_s,
            # On a GPU the first step compiles its kernels (Triton, fla, Inductor): minutes on a cold kernel
            # cache, with nothing else to show that the run is alive.
            first_step_note=compiles if self.device.type == "cuda" else None)
        try:
            result = loop.run(stop_at)
        finally:
            if self._profiler is not None:
                self._profiler.close()  # stopped inside the window: what was profiled is still written
        summary: dict[str, Any] = {"start_step": result.start_step, "stopped": result.stopped}
        if result.first_eval is not None:
            summary["first_val_loss"] = result.first_eval["val_loss"]
        if self._first_step_s is not None:
            summary["first_step_s"] = self._first_step_s
        if result.last_eval is not None:
            summary["last_val_loss"] = result.last_eval["val_loss"]
            if "val_image_loss" in result.last_eval:
                summary["last_val_image_loss"] = result.last_eval["val_image_loss"]
        if self._profiler is not None and self._profiler.written is not None:
            summary["profile"] = str(self._profiler.written)
        summary.update(steps=result.steps, train_seconds=result.seconds,
                       tokens_per_s=self._tokens_seen / result.seconds if result.seconds > 0 else 0.0)
        if self.images is not None:
            summary["image_examples"] = len(self.images.train_examples)
            summary["skipped_image_records"] = len(self.images.skipped)
            if self.images.skipped:
                self.log(f"{len(self.images.skipped)} bad image-text record(s) were skipped (--skip-bad-images), "
                         f"e.g. {self.images.skipped[0]}")
        return summary

    def _step_profiler(self) -> StepProfiler | None:
        """--profile: torch.profiler over a window of steps (k3.train.profile)."""
        if self.profile_dir is None:
            return None
        first = self.step + PROFILE_AFTER + 1 if self.profile_at is None else self.profile_at
        if first <= self.step:
            raise ValueError(f"--profile-at {first}: this run resumes after step {self.step}; profile a later step")
        profiler = StepProfiler(self.profile_dir, first, self.device, vision=self.images is not None)
        if self.images is not None:
            self.images.split = profiler.vision_split  # the tower's share of the profiled steps
        if profiler.first > self.config.max_steps:
            why = (f"it skips the first {PROFILE_AFTER} steps, which compile kernels" if self.profile_at is None
                   else "--profile-at")
            self.log(f"--profile: the run ends before step {profiler.first}, where the profile would start "
                     f"({why}); nothing profiled")
        return profiler

    def _loop_step(self) -> tuple[dict[str, Any], torch.Tensor]:
        if self._profiler is not None:
            self._profiler.before(self.step + 1)
        pending = self._train_step()
        self._tokens_seen += pending[0]["tokens"]
        return pending

    def _loop_read(self, pending: list[tuple[dict[str, Any], torch.Tensor]], seconds: float) -> list[dict[str, Any]]:
        records = self._read_window(pending, seconds)
        if self._profiler is not None:
            self._profiler.after(self.step, records[-1]["step_seconds"])
            if self.step == self._profiler.last:
                self.log(f"profile of steps {self._profiler.first}-{self.step} written to {self._profiler.written}")
        if self._first_step_s is None:  # the session's first step is read on its own
            self._first_step_s = records[0]["step_seconds"]
            if self.device.type == "cuda" and not self._compile_logged:  # once a process: a later train() call
                self._compile_logged = True                               # on this Trainer compiles nothing
                self.log(f"first step took {self._first_step_s:.1f} s (kernel compiles included)")
        return records

    def _evaluations(self) -> dict[str, float]:
        """The validation losses the loop writes at its evaluations: text, and images when the run has them."""
        values = {"val_loss": self.evaluate()}
        if self.images is not None and self.images.val_examples:
            values["val_image_loss"] = self.evaluate_images()
        return values

    def _train_step(self) -> tuple[dict[str, Any], torch.Tensor]:
        """One optimizer step, with no host sync of its own: (the step's host-side metrics, its device-side values
        as one float64 vector: loss, grad norm, maxvio per MoE layer, device-counted QB updates), which
        _read_window turns into the metrics record."""
        config = self.config
        lr = lr_at(self.step, config.max_steps, config.optim.lr, config.optim.warmup_steps, config.optim.min_lr_ratio)
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
        if self.config.parallel.global_batch and self.dist is not None:
            loss, logged_loss = self._global_mean(loss, batch)
        if not graphed:
            loss.backward()
            if self.images is not None and self.images.split is not None:
                self.images.split.backward_done()
        if self.bf16_params:  # the gradients' fp32 norm; the master step applies the clip (no images then)
            grad_norm = self.optimizer.clip_grad_norm_(config.optim.grad_clip)
        else:
            trained = [*self.model.parameters(), *(self.images.trained_parameters() if self.images is not None else [])]
            grad_norm = clip_grad_norm_(trained, config.optim.grad_clip)  # any parallel layout
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
                    f"({self.out / CHECKPOINT_NAME}, step {self.run_dir.saved_step()}) was kept. Lower --lr, raise "
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


def train(config: TrainConfig, resume: bool = False, **kwargs: Any) -> dict[str, Any]:
    """Build a Trainer and run it; see Trainer.train for the summary."""
    return Trainer(config, resume=resume, **kwargs).train()
