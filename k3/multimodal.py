"""K3ForConditionalGeneration: the K3 language model with its vision part; image embeddings enter the token
stream at the media placeholder positions.

    processor = ImageProcessor.for_vision(model.vision.config)
    batch = processor([image])                                         # pixel_values, grid_thw
    ids = expand_placeholders(prompt_ids, batch.tokens_per_image, model.media_token_id)
    out = model(torch.tensor([ids]), batch.pixel_values, batch.grid_thw, labels=...)   # training / scoring

Generation with a cache: the first (prefill) forward takes the images, every later step plain token ids:
    cache = model.new_cache(1)
    logits = model(ids, pixel_values, grid_thw, cache=cache).logits    # = language_model(inputs_embeds=...)
    logits = model(next_ids, cache=cache).logits                       # no placeholders in decode steps
or, for an engine that drives the text model itself, `embeds = model.embed_multimodal(ids, pixel_values,
grid_thw)` and `model.language_model(None, cache, inputs_embeds=embeds)` for the prefill.

Checkpoints: the state dict holds `language_model.*` (K3ForCausalLM's own names) and `vision.vision_tower.*`,
`vision.mm_projector.*`; the published HF layout (`language_model.*`, `vision_tower.*`, `mm_projector.*`) is
read by `from_pretrained` and written by `save_pretrained` of k3.checkpoint.hf_multimodal.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import ModelConfig
from k3.model import CausalLMOutput, K3ForCausalLM
from k3.vision.config import VisionConfig
from k3.vision.model import VisionModel

# `<|media_pad|>` in the Kimi tokenizers (transformers' Kimi_K25Config.image_token_id).
DEFAULT_MEDIA_TOKEN_ID = 163605


class K3ForConditionalGeneration(nn.Module):
    def __init__(self, config: ModelConfig, vision_config: VisionConfig,
                 media_token_id: int = DEFAULT_MEDIA_TOKEN_ID) -> None:
        super().__init__()
        if vision_config.text_hidden_size != config.hidden_size:
            raise ValueError(f"the vision projector writes width {vision_config.text_hidden_size} but the text "
                             f"model is {config.hidden_size} wide; set VisionConfig.text_hidden_size to match")
        if not 0 <= media_token_id < config.vocab_size:
            raise ValueError(f"media_token_id {media_token_id} is outside the vocabulary [0, {config.vocab_size})")
        self.config, self.vision_config, self.media_token_id = config, vision_config, media_token_id
        self.language_model = K3ForCausalLM(config)
        self.vision = VisionModel(vision_config)

    def new_cache(self, batch_size: int):
        return self.language_model.new_cache(batch_size)

    def embed_multimodal(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                         grid_thw: torch.Tensor | None = None,
                         image_embeds: torch.Tensor | None = None,
                         num_placeholders: int | None = None) -> torch.Tensor:
        """input_ids [B, T] with one media token per merged image token -> inputs_embeds [B, T, d].

        The images' embeddings (from pixel_values + grid_thw, or given as image_embeds [M, d]) replace the media
        tokens' embeddings in reading order: batch row by row, left to right, images in grid_thw order.
        num_placeholders: the media tokens in input_ids, when the caller counted them on the host (else they are
        counted here, a sync when input_ids live on a GPU); grid_thw is best given on the CPU, for the same reason."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        mask = input_ids == self.media_token_id
        embeds = self.language_model.model.embed_tokens(input_ids)
        if image_embeds is None and pixel_values is not None:
            if grid_thw is None:
                raise ValueError("pixel_values need their grid_thw [num_images, 3]")
            image_embeds = self.vision(pixel_values, grid_thw)
        placeholders = int(mask.sum()) if num_placeholders is None else num_placeholders
        given = 0 if image_embeds is None else image_embeds.shape[0]
        if placeholders != given:
            raise ValueError(f"input_ids hold {placeholders} media placeholder token(s) ({self.media_token_id}) "
                             f"but the images give {given} embedding(s); expand each image's placeholder to its "
                             f"(h/2)*(w/2) tokens (k3.vision.processing.expand_placeholders)")
        if given == 0:
            return embeds
        return embeds.masked_scatter(mask.unsqueeze(-1), image_embeds.to(embeds.dtype))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                grid_thw: torch.Tensor | None = None, cache=None, cu_seqlens: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> CausalLMOutput:
        """Logits [B, T, V] (and the loss for labels [B, T], -100 ignored; mask the placeholder positions out of
        labels, they are not text to predict)."""
        inputs_embeds = self.embed_multimodal(input_ids, pixel_values, grid_thw)
        return self.language_model(None, cache=cache, cu_seqlens=cu_seqlens, labels=labels,
                                   inputs_embeds=inputs_embeds)


def count_multimodal_parameters(config: ModelConfig, vision_config: VisionConfig) -> dict[str, int]:
    from k3.model import count_parameters
    from k3.vision.model import count_vision_parameters

    return {**count_parameters(config), **count_vision_parameters(vision_config)}
