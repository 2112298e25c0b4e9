"""Native multimodality: the MoonViT3d vision tower, its projector and image processing (SPEC §10).

    from k3.checkpoint.hf_vision import load_vision    # reading files is checkpoint/'s
    from k3.vision import ImageProcessor
    vision = load_vision("/path/to/K3-or-kimi_k25-checkpoint")
    batch = ImageProcessor.for_vision(vision.config).preprocess([pil_image])
    embeds = vision(batch.pixel_values, batch.grid_thw)   # [merged tokens, text width]

Config: config.py; tower: tower.py (rope.py, attention.py); projector: projector.py; tower + projector:
model.py; images and placeholders: processing.py; checkpoint names and config: checkpoint.py; image-text training
data (JSONL) and its packed rows: image_text.py, image_batches.py; a synthetic visual QA set and a tiny vision-language model
that learns it on a CPU (`k3 vision demo`): synthetic_qa.py, demo.py, cli.py. See docs/vision.md.
"""

from k3.vision.checkpoint import read_vision_config
from k3.vision.config import VISION_PRESETS, VisionConfig, vision_config_from_hf, vision_config_to_hf
from k3.vision.model import VisionModel, count_vision_parameters
from k3.vision.processing import ImageProcessor, ProcessedImages, expand_placeholders, open_image
from k3.vision.tower import MoonViT3d

__all__ = ["read_vision_config", "VisionConfig", "VISION_PRESETS", "vision_config_from_hf",
           "vision_config_to_hf", "VisionModel", "count_vision_parameters", "MoonViT3d", "ImageProcessor",
           "ProcessedImages", "expand_placeholders", "open_image"]
