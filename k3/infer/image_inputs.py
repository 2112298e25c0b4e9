"""Chat image parts -> engine inputs, for `k3 serve` with a multimodal model (K3ForConditionalGeneration).

The chat template renders each image part as a marker; the text around the markers is tokenized piece by
piece and each marker becomes one media placeholder token, expanded to the image's merged-token count. The
vision tower turns the images into embeddings that the engine prefills at those positions
(`Engine.add_request(..., prompt_embeds=...)`); decoding then runs on ids as for any prompt.
"""

from __future__ import annotations

import torch


class ImageInputs:
    """model: K3ForConditionalGeneration (its language model is what the engine runs)."""

    def __init__(self, model) -> None:
        from k3.vision.processing import ImageProcessor

        self.model = model
        self.processor = ImageProcessor.for_vision(model.vision.config)
        self.media_token_id = model.media_token_id

    def prompt(self, text: str, marker: str, urls: list, tokenizer,
               local_files: bool = False) -> tuple[list[int], torch.Tensor]:
        """text: the templated prompt with `marker` once per image, in the order of urls (data: URLs; with
        local_files also paths, for the command line) -> (token ids with every image's placeholders, input
        embeddings [len(ids), D]). ValueError for an image that cannot be read or a marker count that does
        not match."""
        from k3.vision.processing import expand_placeholders

        pieces = text.split(marker)
        if len(pieces) - 1 != len(urls):
            raise ValueError(f"the chat template kept {len(pieces) - 1} of the {len(urls)} image part(s); a "
                             f"template must render each message's content")
        for i, url in enumerate(urls):
            if not local_files and not str(url).startswith("data:"):
                raise ValueError(f"image {i}: only data: URLs are accepted ('data:image/png;base64,...'); this "
                                 f"server fetches nothing from the network, got {url[:40]!r}")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            ids.extend(tokenizer.encode(piece) if piece else [])
            if i < len(urls):
                ids.append(self.media_token_id)
        images = self.processor(urls)
        ids = expand_placeholders(ids, images.tokens_per_image, self.media_token_id)
        device = next(self.model.parameters()).device
        dtype = next(self.model.vision.parameters()).dtype
        with torch.no_grad():
            # grid_thw and the placeholder count from the host: the tower reads sizes there (no device sync)
            embeds = self.model.embed_multimodal(torch.tensor([ids], device=device),
                                                 images.pixel_values_on(device, dtype), images.grid_thw,
                                                 num_placeholders=ids.count(self.media_token_id))
        return ids, embeds[0]
