"""Read and write the vision part of a K3 / Kimi-K2.5 Hugging Face-format directory.

    vision = load_vision("/path/to/checkpoint")        # VisionModel, eval mode
    embeds = vision(pixel_values, grid_thw)             # [merged tokens, text width]

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
from k3.vision.tower import PositionGrid, sincos_table

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# Other spellings of published names: (prefix as found, prefix it stands for).
_RENAMES = (
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ("model.mm_projector.", "mm_projector."),
    ("model.vision_tower.", "vision_tower."),
)
_IN_MEMORY_MARKERS = (".layers.", ".attn.q_proj.", ".in_proj.", ".out_proj.", "position_embeddings")


def published_name(name: str) -> str | None:
    """The published name of a checkpoint tensor of the vision part, or None for any other tensor."""
    for found, meant in _RENAMES:
        if name.startswith(found):
            return meant + name[len(found):]
    return name if name.startswith(VISION_PREFIXES) else None


def read_vision_config(path: str | os.PathLike) -> VisionConfig:
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


def _open(file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {error}") from error


def load_vision_state(path: str | os.PathLike, config: VisionConfig, dtype: torch.dtype | None = None,
                      device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """{published name: tensor} of every vision tensor in the directory, checked against `config`'s shapes."""
    from k3.checkpoint.hf_load import weight_map

    directory = Path(path)
    mapping = weight_map(directory)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in VisionModel(config).state_dict().items()}
    wanted: dict[str, list[tuple[str, str]]] = {}
    unknown: list[str] = []
    for name, file in mapping.items():
        native = published_name(name)
        if native is None:
            continue
        if native not in shapes:
            unknown.append(name)
            continue
        wanted.setdefault(file, []).append((name, native))
    state: dict[str, torch.Tensor] = {}
    for file, names in sorted(wanted.items()):
        with _open(directory / file) as handle:
            for name, native in names:
                if native in state:
                    raise ValueError(f"{directory}: {name} fills {native} a second time; the checkpoint holds the "
                                     f"same tensor under two names")
                value = handle.get_tensor(name)
                if tuple(value.shape) != shapes[native]:
                    raise ValueError(f"{directory / file}: {name} has shape {tuple(value.shape)} but config.json's "
                                     f"vision_config implies {shapes[native]}; the weights do not belong to it")
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                state[native] = value.to(device)
    missing = sorted(set(shapes) - set(state))
    if missing:
        hint = ""
        if any(marker in n for n in unknown for marker in _IN_MEMORY_MARKERS):
            hint = (" (its names look like transformers' in-memory kimi_k25 layout; save the model with "
                    "transformers' save_pretrained, which writes the published layout)")
        elif not any(published_name(n) for n in mapping):
            hint = " (it holds no vision_tower.* / mm_projector.* tensors: a text-only checkpoint?)"
        raise ValueError(f"{directory} lacks {len(missing)} vision tensor(s) the config needs, e.g. "
                         f"{missing[:4]}{hint}")
    if unknown:
        raise ValueError(f"{directory}: {len(unknown)} vision tensor(s) that this vision_config has no place for, "
                         f"e.g. {unknown[:4]}; config.json and the weights disagree")
    return state


def load_vision(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                device: str | torch.device = "cpu") -> VisionModel:
    """The vision tower + projector of a K3 or transformers kimi_k25 directory, in eval mode.

    dtype None keeps the stored dtype; a dtype (or 'bfloat16', 'float32', ...) converts floating tensors."""
    from k3.checkpoint.hf_load import parse_dtype

    dtype = parse_dtype(dtype)
    config = read_vision_config(path)
    state = load_vision_state(path, config, dtype, device)
    with torch.device("meta"):
        model = VisionModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():  # non-persistent buffers are not in the files: rebuild them
        if isinstance(module, PositionGrid):
            module.time_weight = sincos_table(config.pos_emb_time, config.hidden_size).to(device)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"after loading, {still_meta[:5]} are still unmaterialised (meta tensors)")
    return model.eval()


def vision_tensors(model: VisionModel, dtype: torch.dtype | None = None):
    """(published name, tensor) pairs of a VisionModel, one at a time."""
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor.contiguous()
