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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from k3.data.packing import filler_length
from k3.rl.chat_format import render_ids
from k3.rl.demos import read_demonstrations
from k3.rl.run_dir import open_run, policy_from, save_run, start_or_restore
from k3.runtime import autocast_dtype, resolve_device
from k3.train.metrics import MetricsLog
from k3.train.optim import build_optimizer, lr_at


@dataclass
class SFTConfig:
    run: str = ""  # the starting checkpoint (a run directory); empty when a model is passed in from Python
    data: str = ""  # demonstrations JSONL
    out: str = "runs/sft"
    steps: int = 200
    batch_size: int = 16  # examples per step
    lr: float = 1e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_tokens: int = 2048  # longer examples are cut
    seed: int = 0
    save_every: int = 100
    device: str = "auto"
    # Packed batches padded to a multiple of this many tokens (a filler document with ignored labels), so the
    # GPU kernels meet a few lengths instead of a new one every step. None: PACK_MULTIPLE_CUDA on CUDA, 0 else.
    # The filler's tokens do pass the routers, so they count in the loads the MoE balancer sees.
    pack_multiple: int | None = None
    # Image parts in the data (docs/vision.md): see k3.train.trainer.TrainConfig for each field.
    vision: str | None = None  # a new tower's preset when the starting run has none
    vision_train: str = "all"
    vision_lr: float | None = None
    max_image_patches: int | None = None
    max_image_pixels: int | None = None
    max_image_bytes: int = 32 << 20
    skip_bad_images: bool = False
    allow_image_paths_outside: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
                 steps_override: int | None = None) -> None:
        """resume: continue DIR/checkpoint.pt with its saved settings (``steps_override`` may extend it)."""
        self.log, self.show_progress = log, show_progress
        self.out = Path(config.out)
        state = open_run(self.out, resume, "sft", "k3 sft", "an SFT run")
        if state is not None:
            saved = SFTConfig(**state["sft"])
            config = dataclasses.replace(saved, out=config.out, steps=steps_override or saved.steps)
        self.config = config
        self.device = resolve_device(config.device)
        self.autocast = autocast_dtype("auto", self.device)
        torch.manual_seed(config.seed)
        policy = policy_from(state, self.out, self.device, model, tokenizer)
        if policy is not None:
            model, tokenizer = policy
        else:
            if not config.run:
                raise ValueError("give the starting checkpoint: --run DIR (a `k3 train` run)")
            from k3.checkpoint.inference import load_for_inference

            model, tokenizer = load_for_inference(config.run, None, str(self.device))
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
            add_vision_param_groups(self.optimizer, self.multimodal.vision, config.lr, config.vision_lr,
                                    config.weight_decay)
        self.step = start_or_restore(self.out, state, self.optimizer, tokenizer, "sft_config.json",
                                     config.to_dict(), model.config.to_dict())
        self.metrics = MetricsLog(self.out / "metrics.jsonl", keep_through_step=self.step if resume else None)

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
            vision_config = vision_config_for(config.vision, "", self.model.config.hidden_size)
            media = media_token_id_for(self.tokenizer)
            if media >= self.model.config.vocab_size:
                raise ValueError(f"{config.data} has images, but the model's vocabulary "
                                 f"({self.model.config.vocab_size} ids) has no room for a media token (id {media}); "
                                 f"start from a run trained on image-text data (k3 train --data images.jsonl)")
            self.log(f"the starting run has no vision tower: a new one ({config.vision or 'tiny'} preset) is trained")
        with torch.device("meta"):
            multimodal = K3ForConditionalGeneration(self.model.config, vision_config, media)
        multimodal.language_model = self.model
        multimodal.vision = VisionModel(vision_config).to(self.device)
        if "vision" in source:
            from k3.checkpoint.native import load_model_state
            load_model_state(multimodal.vision, source["vision"], "the starting run" if state is None else
                             str(self.out))
            multimodal.vision.to(self.device)
        set_vision_trainable(multimodal.vision, config.vision_train)
        return multimodal

    def _read_image_examples(self) -> None:
        from k3.train.images import image_processor
        from k3.vision.image_text import ImageDataOptions, read_image_text
        from k3.vision.pixel_cache import PixelCache

        config = self.config
        self.processor = image_processor(self.multimodal.vision.config, config.max_image_patches,
                                         config.max_image_pixels)
        self.pixels = PixelCache(self.processor)  # each image decoded once, not at every step
        options = ImageDataOptions(max_tokens=config.max_tokens, skip_bad=config.skip_bad_images,
                                   allow_outside=config.allow_image_paths_outside,
                                   max_image_bytes=config.max_image_bytes)
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
        save_run(self.out, self.model, self.optimizer, "sft", self.config.to_dict(), self.step, extra)

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        config = self.config
        self.model.train()
        first = None
        bar = tqdm(total=config.steps, initial=self.step, desc="sft", unit="step", disable=not self.show_progress,
                   dynamic_ncols=True)
        loss_value = float("nan")
        while self.step < config.steps and (stop_at is None or self.step < stop_at):
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
                    ids, embeds = None, embed_images(self.multimodal, ids, images.pixel_values, images.grid_thw)
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
            loss_value = float(loss.detach())
            first = loss_value if first is None else first
            self.metrics.write({"step": self.step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                                "tokens": int(labels.shape[1]), "step_s": time.perf_counter() - t0})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
            if self.step % config.save_every == 0 or self.step == config.steps:
                self.save()
        bar.close()
        self.model.eval()
        summary = {"steps": self.step, "first_loss": first, "last_loss": loss_value}
        if self.multimodal is not None:
            summary["skipped_image_records"] = len(self.skipped)
        return summary
