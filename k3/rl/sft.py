"""Supervised warm start: fine-tune on chat-formatted trajectories (k3.rl.demos), loss on assistant tokens only.

Examples are rendered with k3.rl.chat_format (the same ids RL samples), packed into one row per step
(cu_seqlens: no attention across examples), and trained with AdamW under the trainer's warmup + cosine
schedule. The run directory is laid out as `k3 train`'s (checkpoint.pt with model, optimizer, config,
step, RNG and tokenizer; config.json; tokenizer/; metrics.jsonl), so `k3 rl --run` and `k3 generate --run`
read it. Resume is exact: the examples of a step follow from (seed, step).

Images: when the data has image parts (k3.vision.image_text's format: chat messages with OpenAI image_url parts),
or the starting run has a vision tower, the model is K3ForConditionalGeneration: the tower comes from the
starting run (a `k3 train` run on image-text data), or is new (`vision`, a vision preset) when it has none, and
is trained as `vision_train` says at `vision_lr`; the checkpoint keeps it (vision, vision_config,
media_token_id) as `k3 train` does.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from k3.checkpoint.inference import load_trainable
from k3.cli_config import from_dict, from_flat, option, section
from k3.data.packing import filler_length
from k3.rl.chat_format import render_ids
from k3.rl.demos import read_demonstrations
from k3.runtime import autocast_dtype, resolve_device
from k3.train.config import ImageConfig
from k3.train.loop import Cadence, LoopHooks, TrainingLoop
from k3.train.optim import build_optimizer, lr_at
from k3.train.run_dir import RunKind, open_run

RUN = RunKind(key="sft", settings_file="sft_config.json", command="k3 sft", what="an SFT run")


@dataclass
class SFTConfig:
    """A `k3 sft` run. Each field's docstring is its --help text (k3.cli_config builds the flags); the image
    fields sit in an ImageConfig section as in k3 train, keeping their flat names (--vision, --max-image-bytes), so a
    saved sft_config.json of either layout reads back (SFTConfig.from_dict). Build it by flat names with
    SFTConfig.flat(vision="tiny", lr=1e-3)."""

    run: str = ""
    """starting checkpoint (a k3 train run directory; empty when a model is passed in from Python)"""
    data: str = ""
    """demonstrations JSONL ({"messages": [...]} per line; k3 rl demos writes one); content may hold image_url parts
    (docs/vision.md): the vision tower is then trained too"""
    out: str = field(default="runs/sft", metadata=option(required=True))
    """the SFT run directory"""
    steps: int = 200
    """optimizer steps in all; the cosine schedule's length (with --resume: extend the run to this many)"""
    time_budget_s: float | None = None
    """stop cleanly once training has run this long: then a save, the steps run reported
    (with --resume: this session's budget)"""
    batch_size: int = 16
    """examples per step, packed into one row"""
    lr: float = 1e-3
    """peak learning rate, after a linear warmup, then cosine to min_lr_ratio of it"""
    warmup_steps: int = 10
    """steps of linear warmup"""
    min_lr_ratio: float = field(default=0.1, metadata=option(cli=False))
    """the cosine schedule's floor, as a share of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this"""
    max_tokens: int = 2048
    """longer examples are cut to this many tokens"""
    seed: int = 0
    """seed of the example draws (and of a new vision tower's weights)"""
    save_every: int = 100
    """steps between checkpoints (one is also written at the end)"""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N (default auto: cuda if available)"""
    pack_multiple: int | None = None
    """pad each packed batch to a multiple of this many tokens (a filler document with ignored labels), so GPU kernels
    meet a few lengths instead of a new one every step; the filler passes the routers, so it counts in the MoE
    balancer's loads (default: 2048 on CUDA, k3.data.packing.PACK_MULTIPLE_CUDA; 0 elsewhere)"""
    images: ImageConfig = section(ImageConfig, no_flag=("image_fraction",))  # SFT rows are all chat examples

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def flat(cls, **fields: Any) -> SFTConfig:
        """Built from flat names, as the flags call the fields: SFTConfig.flat(vision="tiny", steps=40)."""
        return from_flat(cls, fields)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SFTConfig:
        """A saved sft_config.json or checkpoint["sft"]: the sectioned layout, or the flat one of earlier runs."""
        return from_dict(cls, data)


def sft_rows(messages: list[dict], tokenizer, max_tokens: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of one example: labels[t] is ids[t+1] where that token is an assistant token, else -100
    (the model's loss takes labels aligned with its logits, no shift inside)."""
    ids, mask = render_ids(messages, tokenizer)
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    labels = [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
    return ids, labels


class SFTTrainer:
    def __init__(self, config: SFTConfig, resume: bool = False, model=None, tokenizer=None,
                 log: Callable[[str], None] = print, show_progress: bool = True,
                 resume_overrides: dict[str, Any] | None = None) -> None:
        """resume: continue DIR/checkpoint.pt with its saved settings; resume_overrides: the fields (flat names) the
        command line replaces, e.g. {"steps": 400, "time_budget_s": 3600} (None: keep the saved one)."""
        self.log, self.show_progress = log, show_progress
        opened = open_run(RUN, config, resume, SFTConfig.from_dict, **(resume_overrides or {}))
        self.run_dir, state, self.config = opened.directory, opened.state, opened.config
        config, self.out = self.config, self.run_dir.out
        self.device = resolve_device(config.device)
        self.autocast = autocast_dtype("auto", self.device)
        torch.manual_seed(config.seed)
        model, tokenizer = opened.policy(self.device, model, tokenizer, source=config.run, load=load_trainable,
                                         needs="give the starting checkpoint: --run DIR (a `k3 train` run)")
        if tokenizer is None:
            raise ValueError("SFT needs the model's tokenizer")
        self.model, self.tokenizer = model.to(self.device), tokenizer
        self.multimodal, self.skipped = self._vision(state), []
        if self.multimodal is None:
            self.examples = [sft_rows(m, tokenizer, config.max_tokens) for m in read_demonstrations(config.data)]
            self.example_images: list[list[str]] = [[] for _ in self.examples]
        else:
            self._read_image_examples()
        self.optimizer = build_optimizer(self.model, config.lr, config.weight_decay)
        if self.multimodal is not None:
            from k3.train.images import add_vision_param_groups
            add_vision_param_groups(self.optimizer, self.multimodal.vision, config.lr, config.images.vision_lr,
                                    config.weight_decay)
        self.step = self.run_dir.start_or_restore(state, self.optimizer, tokenizer, config.to_dict(),
                                                  model.config.to_dict())
        self.metrics = self.run_dir.metrics(self.step, resumed=state is not None)

    def _vision(self, state: dict | None):
        """K3ForConditionalGeneration around self.model when the run has or needs a vision tower, else None."""
        from k3.vision.image_text import has_images

        config = self.config
        if state is not None:
            source = state
        elif config.run:  # a full checkpoint may hold a tower; a sharded one (no image-text runs) does not
            from k3.checkpoint.native import load_checkpoint
            from k3.checkpoint.run import saved_format
            run = Path(config.run)
            source = load_checkpoint(run) if run.is_file() or saved_format(run) == "full" else {}
        else:
            source = {}
        if "vision" not in source and not (config.data and has_images(config.data)):
            return None
        from k3.multimodal import K3ForConditionalGeneration
        from k3.train.images import set_vision_trainable, vision_config_for
        from k3.vision.config import VisionConfig
        from k3.vision.image_text import media_token_id_for
        from k3.vision.model import VisionModel

        if "vision" in source:
            vision_config, media = VisionConfig.from_dict(source["vision_config"]), int(source["media_token_id"])
        else:
            vision_config = vision_config_for(config.images.vision, "", self.model.config.hidden_size)
            media = media_token_id_for(self.tokenizer)
            if media >= self.model.config.vocab_size:
                raise ValueError(f"{config.data} has images, but the model's vocabulary "
                                 f"({self.model.config.vocab_size} ids) has no room for a media token (id {media}); "
                                 f"start from a run trained on image-text data (k3 train --data images.jsonl)")
            self.log(f"the starting run has no vision tower: a new one ({config.images.vision or 'tiny'} preset) is "
                     f"trained")
        with torch.device("meta"):
            multimodal = K3ForConditionalGeneration(self.model.config, vision_config, media)
        multimodal.language_model = self.model
        multimodal.vision = VisionModel(vision_config).to(self.device)
        if "vision" in source:
            from k3.checkpoint.native import load_model_state
            load_model_state(multimodal.vision, source["vision"], "the starting run" if state is None else
                             str(self.out))
            multimodal.vision.to(self.device)
        set_vision_trainable(multimodal.vision, config.images.vision_train)
        return multimodal

    def _read_image_examples(self) -> None:
        from k3.train.images import image_processor
        from k3.vision.image_text import ImageDataOptions, read_image_text
        from k3.vision.pixel_cache import PixelCache

        config = self.config
        self.processor = image_processor(self.multimodal.vision.config, config.images.max_image_patches,
                                         config.images.max_image_pixels)
        self.pixels = PixelCache(self.processor)  # each image decoded once, not at every step
        options = ImageDataOptions(max_tokens=config.max_tokens, skip_bad=config.images.skip_bad_images,
                                   allow_outside=config.images.allow_image_paths_outside,
                                   max_image_bytes=config.images.max_image_bytes)
        data = read_image_text([config.data], self.tokenizer, self.processor, self.multimodal.media_token_id, options)
        if not data.examples:
            raise ValueError(f"{config.data} holds no usable example ({len(data.skipped)} skipped as bad)")
        self.examples = [(e.ids, e.labels) for e in data.examples]
        self.example_images = [e.images for e in data.examples]
        self.skipped = data.skipped
        if data.skipped:
            self.log(f"{len(data.skipped)} bad record(s) skipped (--skip-bad-images), e.g. {data.skipped[0]}")

    def _chosen(self, step: int) -> list[int]:
        rng = random.Random(f"{self.config.seed}/{step}")
        return [rng.randrange(len(self.examples)) for _ in range(self.config.batch_size)]

    def batch_images(self, step: int):
        """The processed images of step ``step``'s examples, in reading order (None when they have none)."""
        images = [source for i in self._chosen(step) for source in self.example_images[i]]
        return self.pixels(images) if images else None

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [1, total], labels [1, total], cu_seqlens [n+1]) of step ``step``'s examples."""
        chosen = self._chosen(step)
        ids = [t for i in chosen for t in self.examples[i][0]]
        labels = [t for i in chosen for t in self.examples[i][1]]
        lengths = [len(self.examples[i][0]) for i in chosen]
        filler = filler_length(len(ids), self.config.pack_multiple, self.device)
        if filler:
            ids += [self.tokenizer.eos_token_id] * filler
            labels += [-100] * filler
            lengths.append(filler)
        lengths = torch.tensor(lengths)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
        return (torch.tensor([ids], device=self.device), torch.tensor([labels], device=self.device),
                cu.to(self.device))

    def save(self) -> None:
        extra = None
        if self.multimodal is not None:
            vision = self.multimodal.vision
            extra = {"vision": vision.state_dict(), "vision_config": vision.config.to_dict(),
                     "media_token_id": self.multimodal.media_token_id}
        self.run_dir.save(self.model.state_dict(), self.optimizer.state_dict(), self.model.config.to_dict(),
                          self.config.to_dict(), self.step, extra)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step on the examples of step ``self.step + 1``; returns its metrics record."""
        config = self.config
        t0 = time.perf_counter()
        lr = lr_at(self.step, config.steps, config.lr, config.warmup_steps, config.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # vision groups: vision_lr / lr
        ids, labels, cu = self.batch(self.step + 1)
        images = self.batch_images(self.step + 1) if self.multimodal is not None else None
        with torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                            enabled=self.autocast is not None):
            embeds = None
            if images is not None:
                from k3.train.images import embed_images
                ids, embeds = None, embed_images(self.multimodal, ids, images.patches, images.grid_thw,
                                                 self.processor)
            loss = self.model(ids, cu_seqlens=cu, labels=labels, return_logits=False, inputs_embeds=embeds).loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"SFT loss became {float(loss)} at step {self.step + 1}; lower --lr")
        loss.backward()
        trained = [*self.model.parameters(), *([p for p in self.multimodal.vision.parameters() if p.requires_grad]
                                               if self.multimodal is not None else [])]
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(grad_norm),
                "tokens": int(labels.shape[1]), "step_s": time.perf_counter() - t0}

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Run to ``steps`` (or stop after step ``stop_at``, as an interrupted run would)."""
        self.model.train()
        losses: list[float] = []

        def step() -> dict[str, Any]:
            record = self.train_step()
            losses.append(record["loss"])
            return record

        loop = TrainingLoop(Cadence(self.config.steps, self.config.save_every),
                            LoopHooks(step=step, position=lambda: self.step, save=self.save,
                                      progress=lambda record: {"loss": f"{record['loss']:.3f}"}),
                            metrics=self.metrics, desc="sft", show_progress=self.show_progress, log=self.log,
                            time_budget_s=self.config.time_budget_s)
        result = loop.run(stop_at)
        self.model.eval()
        summary = {"steps": result.steps, "stopped": result.stopped, "first_loss": losses[0] if losses else None,
                   "last_loss": losses[-1] if losses else float("nan")}
        if self.multimodal is not None:
            summary["skipped_image_records"] = len(self.skipped)
        return summary
