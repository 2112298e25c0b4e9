"""Train a tiny vision-language model on the synthetic visual QA set (CPU, minutes) and measure held-out accuracy.

    from k3.vision.train_vqa import train_vqa
    report = train_vqa()     # 1500 steps; {"accuracy", "chance": {"uniform", "majority"}, "per_kind", ...}

The model is K3ForConditionalGeneration with every K3 switch at toy size (KDA + MLA, AttnRes, latent MoE; a
2-layer MoonViT with RMSNorm, QKV width != width and patchmergerv2). Each step draws fresh samples; the loss is
the cross-entropy of the answer token only. Evaluation is on samples from a different seed: the prediction is the
argmax over the question kind's possible answers.
"""

from __future__ import annotations

import random
import time

import torch
from tqdm import tqdm

from k3.config import ModelConfig
from k3.multimodal import K3ForConditionalGeneration
from k3.vision.config import VisionConfig
from k3.vision.processing import ImageProcessor
from k3.vision.synthetic_qa import KINDS, SyntheticVQA


def tiny_vlm(vocab_size: int, media_token_id: int) -> K3ForConditionalGeneration:
    text = ModelConfig.from_preset("debug", vocab_size=vocab_size, moe_balancing="none")
    vision = VisionConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, head_dim=48,
                          pos_emb_height=8, pos_emb_width=8, text_hidden_size=text.hidden_size)
    return K3ForConditionalGeneration(text, vision, media_token_id)


def make_batch(qa: SyntheticVQA, processor: ImageProcessor, samples):
    """(input_ids [B, T], pixel_values, grid_thw, answer ids [B]); every prompt has the same length."""
    images = processor([s.image for s in samples])
    ids = [qa.prompt_ids(s, n) for s, n in zip(samples, images.tokens_per_image)]
    length = max(len(x) for x in ids)
    pad = qa.vocab["<pad>"]
    ids = torch.tensor([[pad] * (length - len(x)) + x for x in ids])  # left pad: the answer follows the last token
    answers = torch.tensor([qa.answer_id(s) for s in samples])
    return ids, images.pixel_values, images.grid_thw, answers


@torch.no_grad()
def evaluate(model, qa: SyntheticVQA, processor: ImageProcessor, count: int, seed: int, batch_size: int = 64):
    rng = random.Random(seed)
    samples = [qa.sample(rng) for _ in range(count)]
    model.eval()
    correct = {kind: [0, 0] for kind in KINDS}
    for start in range(0, count, batch_size):
        chunk = samples[start:start + batch_size]
        ids, pixels, grid, answers = make_batch(qa, processor, chunk)
        logits = model(ids, pixels, grid).logits[:, -1]
        for row, sample in enumerate(chunk):
            options = qa.answer_ids(sample.kind)
            guess = options[int(logits[row, options].argmax())]
            correct[sample.kind][0] += int(guess == int(answers[row]))
            correct[sample.kind][1] += 1
    model.train()
    total = sum(c for c, _ in correct.values())
    return {"accuracy": total / count, "chance": SyntheticVQA.chance(samples),
            "per_kind": {k: c / n for k, (c, n) in correct.items() if n}}


def train_vqa(steps: int = 1500, batch_size: int = 32, lr: float = 5e-3, seed: int = 0, eval_count: int = 512,
              image_size: int = 56, progress: bool = True) -> dict:
    """Images of image_size px (56: a 4x4 patch grid, 4 image tokens, each one quadrant of the picture)."""
    torch.manual_seed(seed)
    qa = SyntheticVQA(size=image_size, seed=seed)
    processor = ImageProcessor(max_patches=(image_size // 14) ** 2)
    model = tiny_vlm(max(64, len(qa.vocab)), qa.media_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    before = evaluate(model, qa, processor, eval_count, seed + 1000)
    started, losses = time.perf_counter(), []
    model.train()
    for _ in tqdm(range(steps), desc="vqa steps", disable=not progress):
        ids, pixels, grid, answers = make_batch(qa, processor, [qa.sample(rng) for _ in range(batch_size)])
        logits = model(ids, pixels, grid).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits.float(), answers)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - started
    after = evaluate(model, qa, processor, eval_count, seed + 1000)
    return {**after, "accuracy_before": before["accuracy"], "steps": steps, "batch_size": batch_size,
            "train_seconds": seconds, "first_loss": losses[0], "last_loss": sum(losses[-20:]) / len(losses[-20:])}
