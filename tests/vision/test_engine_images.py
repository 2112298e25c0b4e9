"""The inference engine with image prompts: prefill from K3ForConditionalGeneration's embeddings (chunked,
cutting through an image), then plain decode, equals recomputing the multimodal forward at every step;
image prompts share a batch with text prompts and fork for n samples."""

from __future__ import annotations

import torch

from k3.config import ModelConfig
from k3.infer import Engine, SamplingParams
from k3.multimodal import K3ForConditionalGeneration
from k3.vision import VisionConfig
from vision_helpers import K3_TINY, random_pixels, randomize

MEDIA = 255


def reference_greedy(model, ids: list[int], pixels, grid_thw, steps: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids + out]), pixels, grid_thw).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_image_prompts_through_the_engine_equal_the_full_forward():
    torch.manual_seed(3)
    model = K3ForConditionalGeneration(ModelConfig.from_preset("debug"), VisionConfig(**K3_TINY), MEDIA)
    randomize(model.vision)
    model.eval()
    pixels, grid_thw = random_pixels([[1, 4, 4], [1, 2, 6]])  # 4 + 3 merged tokens
    image_prompt = [1, 2] + [MEDIA] * 4 + list(range(3, 43)) + [MEDIA] * 3 + [7, 8]
    with torch.no_grad():
        embeds = model.embed_multimodal(torch.tensor([image_prompt]), pixels, grid_thw)[0]
    text_prompt = list(range(10, 60))
    # Chunks of 16 tokens: the second image (positions 46-48) is cut by the chunk boundary at 48.
    engine = Engine(model.language_model, None, max_context=256, max_batch=4, page_size=16, prefill_chunk=16)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    outs = engine.complete([image_prompt, text_prompt], params, prompt_embeds=[embeds, None])
    assert outs[0].outputs[0].token_ids == reference_greedy(model, image_prompt, pixels, grid_thw, 10)
    assert outs[1].outputs[0].token_ids == reference_greedy(model, text_prompt, None, None, 10)
    # Without the embeddings the same ids decode differently: the image did reach the model.
    plain = engine.complete([image_prompt], params)[0].outputs[0].token_ids
    assert plain != outs[0].outputs[0].token_ids
    forks = engine.complete([image_prompt], SamplingParams(max_new_tokens=10, temperature=0, n=2),
                            prompt_embeds=[embeds])[0]
    assert all(c.token_ids == outs[0].outputs[0].token_ids for c in forks.outputs)
    assert engine.stats()["kda_slots_used"] == 0 and engine.stats()["mla_pages_used"] == 0
