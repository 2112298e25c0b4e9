"""VisionModel: the MoonViT3d tower and its projector, one call from pixels to text-width embeddings.

    vision = VisionModel(VisionConfig.from_preset("k3"))
    embeds = vision(pixel_values, grid_thw)   # [sum over images of (h/2)*(w/2), text_hidden_size]

The rows come image after image, each row-major over its merged grid: the same contract as transformers'
get_image_features (concatenated). State-dict names are the published ones (`vision_tower.*`, `mm_projector.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.vision.config import VisionConfig
from k3.vision.projector import Projector
from k3.vision.tower import MoonViT3d, PositionGrid, sincos_table


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = MoonViT3d(config)
        self.mm_projector = Projector(config)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) for every matrix, conv filter and the position grid; norms at one/zero;
        biases at zero. Writes every parameter (a meta-built model is whole after to_empty + this)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, PositionGrid):
                nn.init.normal_(module.weight, std=std)
                module.time_weight.copy_(sincos_table(*module.time_weight.shape))

    @property
    def attention_backend(self) -> str:
        return self.vision_tower.attention_backend

    @attention_backend.setter
    def attention_backend(self, backend: str) -> None:
        self.vision_tower.attention_backend = backend

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """Merged tokens (= placeholders in the text) of each image: (h/kh)*(w/kw), whatever its frame count."""
        kh, kw = self.config.merge_kernel
        return [(int(h) // kh) * (int(w) // kw) for _, h, w in grid_thw.tolist()]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, p, p], grid_thw [n, 3] -> [sum(tokens_per_image), text_hidden_size]"""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thw))

    def image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The same embeddings split per image: a tuple of [tokens_i, text_hidden_size]."""
        return torch.split(self(pixel_values, grid_thw), self.tokens_per_image(grid_thw))


def count_vision_parameters(config: VisionConfig) -> dict[str, int]:
    """Parameters of the tower and the projector, counted on the meta device."""
    with torch.device("meta"):
        model = VisionModel(config)
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.mm_projector.parameters())
    return {"vision_params": tower + projector, "vision_tower_params": tower, "mm_projector_params": projector}
