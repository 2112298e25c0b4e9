"""The checkpoint layout of the vision part of a K3 / Kimi-K2.5 Hugging Face-format directory: its tensor names,
its config and its tensors in order. Reading the files is k3.checkpoint.hf_vision's (load_vision).

Published layout (SPEC §10), which is also k3's own state-dict naming:
    vision_tower.patch_embed.proj.{weight,bias}         [D, 3, p, p]
    vision_tower.patch_embed.pos_emb.weight             [64, 64, D]
    vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}.{weight,bias}
    vision_tower.encoder.final_layernorm.{weight,bias}
    mm_projector.{pre_norm,proj.0,proj.2,post_norm}.{weight,bias}
Biases and pre_norm / post_norm exist as the variant has them. transformers' kimi_k25 save_pretrained writes
this layout with two names moved (measured with transformers 5.24): `vision_tower.encoder.patch_embed.proj.*`
and `model.mm_projector.pre_norm.*`; both are read too. Text tensors (`language_model.*`) are left alone here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from k3.vision.config import VisionConfig, vision_config_from_hf
from k3.vision.model import VisionModel

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# Other spellings of published names: (prefix as found, prefix it stands for).
_RENAMES = (
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ("model.mm_projector.", "mm_projector."),
    ("model.vision_tower.", "vision_tower."),
)
# Names of transformers' in-memory layout, which a checkpoint should not hold (named in the error).
IN_MEMORY_MARKERS = (".layers.", ".attn.q_proj.", ".in_proj.", ".out_proj.", "position_embeddings")


def published_name(name: str) -> str | None:
    """The published name of a checkpoint tensor of the vision part, or None for any other tensor."""
    for found, meant in _RENAMES:
        if name.startswith(found):
            return meant + name[len(found):]
    return name if name.startswith(VISION_PREFIXES) else None


def read_vision_config(path: str | os.PathLike) -> VisionConfig:
    """The vision_config of a checkpoint directory's config.json (either spelling)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{Path(path)} has no config.json; load_vision needs a K3 or kimi_k25 "
                                f"checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error})") from error
    try:
        return vision_config_from_hf(raw)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from error


def vision_tensors(model: VisionModel, dtype: torch.dtype | None = None):
    """(published name, tensor) pairs of a VisionModel, one at a time."""
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor.contiguous()
