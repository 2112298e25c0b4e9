"""Read the vision part (tower + projector) of a K3 / Kimi-K2.5 Hugging Face-format directory.

    vision = load_vision("/path/to/checkpoint")        # VisionModel, eval mode
    embeds = vision(pixel_values, grid_thw)             # [merged tokens, text width]

The layout (names, the renames transformers writes, config) is k3.vision.checkpoint's; this module reads files.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from k3.checkpoint.hf_load import open_safetensors, parse_dtype, weight_map
from k3.vision.checkpoint import IN_MEMORY_MARKERS, published_name, read_vision_config
from k3.vision.config import VisionConfig
from k3.vision.model import VisionModel
from k3.vision.tower import PositionGrid, sincos_table


def load_vision_state(path: str | os.PathLike, config: VisionConfig, dtype: torch.dtype | None = None,
                      device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """{published name: tensor} of every vision tensor in the directory, checked against `config`'s shapes."""
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
        with open_safetensors(directory / file) as handle:
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
        if any(marker in n for n in unknown for marker in IN_MEMORY_MARKERS):
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
