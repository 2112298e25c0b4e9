"""Read and write a K3ForConditionalGeneration (text and vision) in the published K3 Hugging Face layout:
`language_model.*`, `vision_tower.*`, `mm_projector.*`, and config.json with text_config, vision_config and
media_placeholder_token_id.

    model = from_pretrained("/path/to/K3-directory")
    save_pretrained(model, tokenizer, "/path/out")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from k3.checkpoint.hf_load import from_pretrained as text_from_pretrained
from k3.checkpoint.hf_save import save_pretrained as text_save_pretrained
from k3.checkpoint.hf_vision import load_vision
from k3.multimodal import DEFAULT_MEDIA_TOKEN_ID, K3ForConditionalGeneration


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: str | torch.device = "cpu", media_token_id: int | None = None,
                    progress: bool = True):
    """K3ForConditionalGeneration from a K3 HF directory holding text and vision weights (the tokenizer loads
    on its own: `k3.load_tokenizer(path)`)."""
    language_model = text_from_pretrained(path, dtype, device, progress)
    vision = load_vision(path, dtype, device)
    raw = json.loads((Path(path) / "config.json").read_text())
    token = media_token_id if media_token_id is not None else int(
        raw.get("media_placeholder_token_id", raw.get("image_token_id", DEFAULT_MEDIA_TOKEN_ID)))
    with torch.device("meta"):
        model = K3ForConditionalGeneration(language_model.config, vision.config, token)
    model.language_model, model.vision = language_model, vision
    return model.eval()


def save_pretrained(model: K3ForConditionalGeneration, tokenizer, path: str | os.PathLike,
                    mxfp4_experts: bool = False, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None, progress: bool = True) -> Path:
    """Write the published K3 layout: text under `language_model.`, `vision_tower.*`, `mm_projector.*`, and
    config.json with text_config, vision_config and media_placeholder_token_id."""
    return text_save_pretrained(model.language_model, tokenizer, path, format="kimi_k3",
                                mxfp4_experts=mxfp4_experts, max_shard_size=max_shard_size, dtype=dtype,
                                progress=progress, vision=model.vision,
                                extra_config={"media_placeholder_token_id": model.media_token_id})
