"""Visual tasks of `k3 eval` on a model with a vision tower, through the inference engine with image prompts.

    vqa   the synthetic visual QA set (k3.vision.synthetic_qa): colour, shape, count, position; a row per kind
          (task "vqa/<kind>") and one over all of them (task "vqa")
    ocr   three letters rendered in the picture, read back in order (kind "text"); one row, task "ocr"

Items are generated held out from a fixed seed, balanced over the kinds and their answers. A prompt is `<bos>`
(when the tokenizer has one), the image's placeholders, then the question's text; the expected completion is
the answer's text and `<eos>` (when the tokenizer has one), which is the format `k3 vision demo` trains on. The
engine decodes greedily as many tokens as the expected completion has; an item counts when they are equal.
Rows are those of the other tasks: {"task", "length", "accuracy", "n"} (and "seconds", "peak_gib" in --json), with
length = the image side in pixels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from k3.eval.harness import TaskResult
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

VISUAL_TASKS = {"vqa": ("colour", "shape", "count", "position"), "ocr": ("text",)}
SEED_OFFSET = 7919  # items of `k3 eval --seed s` differ from the demo's training stream (seed s) and held-out set


@dataclass
class VisualItem:
    kind: str
    prompt: list[int]  # image placeholders expanded
    answer: list[int]
    image: object  # PIL image


def native_image_size(vision_config) -> int:
    """The side in pixels of the tower's stored position grid (the size it is laid out for: 112 for the demo's
    8x8 grid of 14-px patches)."""
    return vision_config.pos_emb_height * vision_config.patch_size


def visual_items(task: str, tokenizer, media_token_id: int, tokens_per_image: int, count: int, seed: int,
                 image_size: int) -> list[VisualItem]:
    """`count` items of `task`, balanced over its kinds, reproducible from (seed, task). tokens_per_image is a
    square image_size picture's; a text picture (wider) gets proportionally more."""
    from k3.vision.synthetic_qa import SyntheticVQA

    if task not in VISUAL_TASKS:
        raise ValueError(f"unknown visual task {task!r}; choose from {sorted(VISUAL_TASKS)}")
    qa = SyntheticVQA(size=image_size)
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    items = []
    for sample in qa.samples(count, seed + SEED_OFFSET + sorted(VISUAL_TASKS).index(task), VISUAL_TASKS[task]):
        question, answer = tokenizer.encode(sample.question), tokenizer.encode(sample.answer)
        if not question or not answer:
            raise ValueError(f"the tokenizer encodes {sample.question!r} / {sample.answer!r} to no tokens")
        width, height = sample.image.size  # text pictures are wider than the square ones
        tokens = tokens_per_image * width * height // (image_size * image_size)
        items.append(VisualItem(sample.kind, bos + [media_token_id] * tokens + question, answer + eos, sample.image))
    return items


@torch.no_grad()
def visual_generate(model, engine: Engine, items: list[VisualItem]) -> list[list[int]]:
    """Greedy completion of each item's image prompt through the engine, as many tokens as its answer has."""
    from k3.vision.processing import ImageProcessor

    vision_config = model.vision.config
    patch = vision_config.patch_size
    largest = max([(i.image.size[0] // patch) * (i.image.size[1] // patch) for i in items], default=4)
    processor = ImageProcessor.for_vision(vision_config, max_patches=largest)  # every picture at its own size
    device = next(model.language_model.parameters()).device
    dtype = next(model.vision.parameters()).dtype
    embeds = []
    for item in items:
        batch = processor([item.image])
        ids = torch.tensor([item.prompt], device=device)
        embeds.append(model.embed_multimodal(ids, batch.pixel_values_on(device, dtype), batch.grid_thw)[0])
    generated: list[list[int]] = [[] for _ in items]
    by_length: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_length.setdefault(len(item.answer), []).append(i)
    for answer_length, indices in by_length.items():
        # No stop tokens: an early EOS is a wrong answer and the comparison sees it.
        params = SamplingParams(max_new_tokens=answer_length, temperature=0.0)
        outputs = engine.complete([items[i].prompt for i in indices], params,
                                  prompt_embeds=[embeds[i] for i in indices])
        for i, out in zip(indices, outputs):
            generated[i] = out.outputs[0].token_ids[:answer_length]
    return generated


def evaluate_visual_tasks(model, tokenizer, tasks: list[str], count: int, seed: int = 0,
                          image_size: int | None = None) -> list[TaskResult]:
    """model: K3ForConditionalGeneration. Every task: `count` items; vqa adds a result per kind."""
    if not hasattr(model, "vision"):
        raise ValueError("the visual tasks (vqa, ocr) need a model with a vision tower; this one is text only "
                         "(train one with `k3 vision demo`, or give a multimodal K3 directory)")
    vision_config = model.vision.config
    image_size = image_size or native_image_size(vision_config)
    step = vision_config.patch_size * vision_config.merge_kernel[0]
    if image_size < 56 or image_size % step:
        raise ValueError(f"--image-size must be a multiple of {step} px and at least 56, got {image_size}")
    tokens_per_image = (image_size // step) ** 2
    results = []
    for task in tasks:
        start = time.perf_counter()
        items = visual_items(task, tokenizer, model.media_token_id, tokens_per_image, count, seed, image_size)
        context = max(len(i.prompt) + len(i.answer) for i in items) + 1
        engine = Engine(model.language_model, tokenizer, max_context=context, max_batch=min(32, count),
                        prefix_cache=False)
        flags = [out == item.answer for out, item in zip(visual_generate(model, engine, items), items)]
        seconds = time.perf_counter() - start
        kinds = VISUAL_TASKS[task]
        results.append(TaskResult(task, image_size, sum(flags), len(flags), seconds))
        if len(kinds) > 1:
            for kind in kinds:
                mine = [f for f, item in zip(flags, items) if item.kind == kind]
                results.append(TaskResult(f"{task}/{kind}", image_size, sum(mine), len(mine), 0.0))
        del engine
    return results
