"""The image-text part of a `k3 train` run: which --data files hold images, the vision tower trained with the
model, image rows mixed into every step, and the vision weights in the checkpoint.

A --data .jsonl whose first record has "images" or "messages" is image-text data (k3.vision.image_text); the
other --data files (or the default corpus when there are none) are the text stream. Each step holds
round(image_fraction * rows) rows of image-text examples beside the text rows; which examples follow from
(seed, step), so a resumed run draws the same ones. The examples are read once and kept in the run directory
(data/images_train.jsonl, data/images_val.jsonl; images by resolved path or data: URL), as the text is.

The model is k3.multimodal.K3ForConditionalGeneration: the trainer's K3ForCausalLM is its language model, and
its VisionModel (a `vision` preset, projector width = the text width) is trained as `vision_train` says:
"all" (tower and projector), "projector" (tower frozen) or "none" (both frozen), at `vision_lr`.

Checkpoint keys beside the text model's: vision ({vision_tower.*, mm_projector.*} tensors), vision_config,
media_token_id; the optimizer holds the trained vision parameters' moments in its own groups.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Callable

import torch

from k3.checkpoint.native import atomic_write_bytes, load_model_state
from k3.data.corpus import expand_data_paths
from k3.data.packing import PackedBatch
from k3.vision.config import VisionConfig
from k3.vision.image_batches import mixed_batch, pack_image_rows
from k3.vision.image_text import ImageDataOptions, ImageTextExample, is_image_text_file, read_image_text
from k3.vision.pixel_cache import PixelCache
from k3.vision.processing import ImageProcessor

VISION_TRAIN = ("all", "projector", "none")
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS: Pillow's own decompression-bomb warning limit


def split_data_files(data: list[str]) -> tuple[list[str], list[Path]]:
    """(text --data entries as given, image-text .jsonl files) of --data."""
    if not data:
        return [], []
    files = expand_data_paths(list(data))
    images = [f for f in files if is_image_text_file(f)]
    if not images:
        return list(data), []
    return [str(f) for f in files if f not in images], images


def vision_config_for(name: str | None, preset: str, text_hidden_size: int) -> VisionConfig:
    """The tower of a new multimodal run: the named vision preset, or "k3" for the k3 text preset and "tiny"
    otherwise, its projector writing the text width."""
    return VisionConfig.from_preset(name or ("k3" if preset == "k3" else "tiny"), text_hidden_size=text_hidden_size)


def image_processor(vision_config: VisionConfig, max_image_patches: int | None,
                    max_image_pixels: int | None) -> ImageProcessor:
    """The K2.5/K3 processor for the tower, with the run's patch budget and decompression-bomb limit."""
    overrides = {"max_input_pixels": max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS}
    if max_image_patches:
        overrides["max_patches"] = max_image_patches
    return ImageProcessor.for_vision(vision_config, **overrides)


def set_vision_trainable(vision, mode: str) -> None:
    """vision_train: "all" trains tower and projector, "projector" freezes the tower, "none" freezes both."""
    if mode not in VISION_TRAIN:
        raise ValueError(f"vision_train must be one of {VISION_TRAIN}, got {mode!r}")
    vision.vision_tower.requires_grad_(mode == "all")
    vision.mm_projector.requires_grad_(mode in ("all", "projector"))


def add_vision_param_groups(optimizer: torch.optim.Optimizer, vision, lr: float, vision_lr: float | None,
                            weight_decay: float) -> None:
    """The trained vision parameters as groups of their own (matrices decayed, as build_optimizer does), their
    lr_scale = vision_lr / lr: a loop that sets group["lr"] = lr * lr_scale keeps the vision on its own peak."""
    scale = (vision_lr or lr) / lr
    decay, no_decay = [], []
    for param in vision.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if params:
            optimizer.add_param_group({"params": params, "weight_decay": wd, "lr": lr * scale, "lr_scale": scale})


def embed_images(multimodal, ids: torch.Tensor, patches: torch.Tensor, grid_thw: torch.Tensor,
                 processor: ImageProcessor, host_ids: torch.Tensor | None = None) -> torch.Tensor:
    """inputs_embeds [1, T, d]: the ids' embeddings with the images' at the media tokens. The uint8 patches
    [N, 3, p, p] move to the ids' device and are normalised there (the processor's mean and std); grid_thw stays
    on the host (the tower reads its sizes there); host_ids, the same ids on the CPU, let the placeholders be
    counted without a device sync."""
    pixel_values = processor.pixel_values_on(patches, ids.device, _vision_dtype(multimodal))
    return multimodal.embed_multimodal(ids, pixel_values, grid_thw.cpu(),
                                       num_placeholders=_placeholders(multimodal, host_ids))


def _vision_dtype(multimodal) -> torch.dtype:
    return next(multimodal.vision.parameters()).dtype


def _placeholders(multimodal, host_ids: torch.Tensor | None) -> int | None:
    if host_ids is None or host_ids.device.type != "cpu":
        return None
    return int((host_ids == multimodal.media_token_id).sum())


def _held_out(source: str, fraction: float) -> bool:
    digest = int.from_bytes(hashlib.sha1(f"validation:{source}".encode()).digest()[:8], "little")
    return digest < fraction * 2**64


class ImageTraining:
    """Built by the Trainer when --data holds image-text files; see the module docstring."""

    def __init__(self, config, files: list[Path], media_token_id: int, vision_config: VisionConfig) -> None:
        if config.parallel.ep or config.checkpoint.format != "full":
            raise ValueError("image-text data trains in one process with --checkpoint-format full (drop --ep and "
                             "--checkpoint-format sharded)")
        if config.images.vision_lr is not None and config.images.vision_lr <= 0:
            raise ValueError(f"vision_lr must be positive, got {config.images.vision_lr} (freeze with vision_train "
                             f"instead)")
        if not 0 < config.images.image_fraction <= 1:
            raise ValueError(f"image_fraction must be in (0, 1], got {config.images.image_fraction}")
        self.config, self.files = config, files
        self.media_token_id, self.vision_config = media_token_id, vision_config
        self.processor = image_processor(vision_config, config.images.max_image_patches, config.images.max_image_pixels)
        self.pixels = PixelCache(self.processor)  # each image decoded once, not at every step
        self.train_examples: list[ImageTextExample] = []
        self.val_examples: list[ImageTextExample] = []
        self.skipped: list[str] = []
        self.multimodal = None
        self.split = None  # k3.train.profile.VisionSplit while --profile times the tower's share of a step

    def rows_per_step(self, rows: int) -> int:
        return max(1, min(rows, round(rows * self.config.images.image_fraction)))

    # --- data --------------------------------------------------------------------------------------------
    def prepare(self, data_dir: Path, tokenizer, row_length: int, log: Callable[[str], None]) -> None:
        """Read the image-text files into examples once (kept in data_dir), or load the kept ones."""
        train_path, val_path = data_dir / "images_train.jsonl", data_dir / "images_val.jsonl"
        if not (train_path.is_file() and val_path.is_file()):
            options = ImageDataOptions(max_tokens=row_length, skip_bad=self.config.images.skip_bad_images,
                                       allow_outside=self.config.images.allow_image_paths_outside,
                                       max_image_bytes=self.config.images.max_image_bytes)
            data = read_image_text(self.files, tokenizer, self.processor, self.media_token_id, options)
            if not data.examples:
                raise ValueError(f"the image-text files {[str(f) for f in self.files]} hold no usable example "
                                 f"({len(data.skipped)} skipped as bad)")
            held = [e for e in data.examples if _held_out(e.source, self.config.data.val_fraction)]
            if len(held) == len(data.examples):
                held = held[:-1]
            held_sources = {e.source for e in held}
            train = [e for e in data.examples if e.source not in held_sources]
            data_dir.mkdir(parents=True, exist_ok=True)
            for path, examples in ((train_path, train), (val_path, held)):
                atomic_write_bytes(path, "".join(json.dumps(e.to_json()) + "\n" for e in examples).encode())
            atomic_write_bytes(data_dir / "images_skipped.json", json.dumps(data.skipped, indent=1).encode())
            images = sum(len(e.images) for e in data.examples)
            log(f"image-text data: {len(train)} train and {len(held)} validation examples ({images} images)"
                + (f"; {len(data.skipped)} bad record(s) skipped (--skip-bad-images), listed in "
                   f"{data_dir / 'images_skipped.json'}" if data.skipped else ""))
        self.train_examples = _load_examples(train_path)
        self.val_examples = _load_examples(val_path)
        skipped_file = data_dir / "images_skipped.json"
        self.skipped = json.loads(skipped_file.read_text()) if skipped_file.is_file() else []

    def batch(self, text: PackedBatch | None, step: int, rows: int, row_length: int, filler_id: int) -> PackedBatch:
        """Step `step`'s batch: the text rows, then `rows` image rows drawn by (seed, step)."""
        rng = random.Random(f"{self.config.seed}/image-rows/{step}")
        image_rows = pack_image_rows(self.train_examples, rows, row_length, filler_id, rng)
        return mixed_batch(text, image_rows, self.pixels)

    def validation_batches(self, count: int, rows: int, row_length: int, filler_id: int) -> list[PackedBatch]:
        """Fixed batches of the held-out examples (the same at every evaluation)."""
        if not self.val_examples:
            return []
        rng = random.Random(f"{self.config.seed}/image-validation")
        return [mixed_batch(None, pack_image_rows(self.val_examples, rows, row_length, filler_id, rng),
                            self.pixels) for _ in range(count)]

    # --- model ---------------------------------------------------------------------------------------------
    def build(self, model_config):
        """K3ForConditionalGeneration; its language_model is initialised as a text-only K3ForCausalLM is."""
        from k3.multimodal import K3ForConditionalGeneration

        self.multimodal = K3ForConditionalGeneration(model_config, self.vision_config, self.media_token_id)
        set_vision_trainable(self.multimodal.vision, self.config.images.vision_train)
        return self.multimodal

    @property
    def vision(self):
        return self.multimodal.vision

    def add_param_groups(self, optimizer: torch.optim.Optimizer, lr: float, weight_decay: float) -> None:
        add_vision_param_groups(optimizer, self.vision, lr, self.config.images.vision_lr, weight_decay)

    def embed(self, ids: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """inputs_embeds [1, T, d]: the ids' embeddings with the batch's images at the media tokens."""
        if self.split is None:
            return embed_images(self.multimodal, ids, batch.image_patches, batch.grid_thw, self.processor,
                                batch.input_ids)
        pixel_values = self.processor.pixel_values_on(batch.image_patches, ids.device, _vision_dtype(self.multimodal))
        with self.split.vision_forward():
            image_embeds = self.vision(pixel_values, batch.grid_thw.cpu())
        self.split.watch(image_embeds)
        return self.multimodal.embed_multimodal(ids, image_embeds=image_embeds,
                                                num_placeholders=_placeholders(self.multimodal, batch.input_ids))

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.vision.parameters() if p.requires_grad]

    # --- checkpoint ----------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {"vision": self.vision.state_dict(), "vision_config": self.vision_config.to_dict(),
                "media_token_id": self.media_token_id}

    def load_checkpoint_state(self, state: dict[str, Any], source: str) -> None:
        if "vision" not in state:
            raise ValueError(f"{source} holds no vision weights; it was not saved by a run with image-text data")
        load_model_state(self.vision, state["vision"], source)


def _load_examples(path: Path) -> list[ImageTextExample]:
    return [ImageTextExample.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
