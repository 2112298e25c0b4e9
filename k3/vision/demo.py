"""`k3 vision demo`: a tiny vision-language model learns the synthetic visual QA set (synthetic_qa.py) on a CPU in
minutes, tower and language model trained together; held-out accuracy per question kind before and after.

    report = run_demo(DemoSettings(), out="runs/vqa")   # report.json, curve.png and the model (HF layout)

The model is K3ForConditionalGeneration with every K3 switch at toy size (KDA + MLA, AttnRes, latent MoE; a
MoonViT with RMSNorm, 2D rotary, QKV width != width, patchmergerv2). A row is `<bos> <image>*n question answer
<eos>`; the loss is the cross-entropy of the answer's tokens and <eos> (teacher-forced), every step on fresh
balanced samples. Held-out samples come from another seed; an answer counts when every one of its tokens and the
<eos> is the argmax given the true prefix, which is what greedy decoding through the engine returns
(`k3 eval --task vqa ocr` checks that on the saved model).

Why the previous recipe (56 px images, patch 14 = a 4x4 patch grid, 4 image tokens, 1500 steps of 32 at lr 5e-3,
loss on one answer token) left shape and count at chance: docs/vision.md ("What held shape and count at
chance, and what did not") has the measured runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.config import ModelConfig
from k3.multimodal import K3ForConditionalGeneration
from k3.vision.config import VisionConfig
from k3.vision.processing import ImageProcessor
from k3.vision.synthetic_qa import KINDS, SyntheticVQA, VQASample

# Dense bf16 peak of one H100 / H200 SXM (the same 989 TFLOP/s for both); the MFU of a step is against it.
GPU_BF16_PEAK_FLOPS = 989e12


@dataclass
class DemoSettings:
    image_size: int = 84  # px; patch 14 -> a 6x6 patch grid, 9 image tokens after the 2x2 merge
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3  # peak (one-cycle: warm-up over the first 10%, cosine down to lr/100)
    vision_lr: float | None = None  # tower + projector; None: lr
    weight_decay: float = 0.0
    loss_per: str = "sample"  # "sample" | "token": see answer_loss
    seed: int = 0
    eval_count: int = 500  # held-out samples, balanced over the kinds
    eval_every: int = 100  # steps between points of the accuracy curve (on a fixed quarter of the held-out set)
    kinds: tuple[str, ...] = tuple(KINDS)
    # the tower
    vision_width: int = 96
    vision_layers: int = 3
    vision_heads: int = 4
    vision_head_dim: int = 32
    patch_size: int = 14
    # the language model: the `debug` preset (width 64) with text_layers layers, KDA and MLA alternating (None:
    # the preset's own)
    text_preset: str = "debug"
    text_layers: int | None = 4
    device: str = "cpu"
    dtype: str = "fp32"  # fp32 | bf16 (autocast on CUDA)
    threads: int | None = None

    def __post_init__(self) -> None:
        self.kinds = tuple(self.kinds)
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {list(KINDS)}, got {list(self.kinds)}")
        step = self.patch_size * 2
        if self.image_size % step or self.image_size < 56:
            raise ValueError(f"image_size must be a multiple of {step} px (patch {self.patch_size} x merge 2) and "
                             f"at least 56, got {self.image_size}")
        for name in ("steps", "batch_size", "eval_count", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or (self.vision_lr is not None and self.vision_lr <= 0):
            raise ValueError("learning rates must be positive")
        if self.loss_per not in ("sample", "token"):
            raise ValueError(f"loss_per must be sample or token, got {self.loss_per!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {self.dtype!r}")


def build_model(settings: DemoSettings, qa: SyntheticVQA) -> K3ForConditionalGeneration:
    layers = settings.text_layers
    cut = {} if layers is None else dict(num_layers=layers, full_attn_layers=list(range(2, layers + 1, 2)))
    text = ModelConfig.from_preset(settings.text_preset, vocab_size=max(64, len(qa.vocab)), moe_balancing="none",
                                   **cut)
    grid = settings.image_size // settings.patch_size
    vision = VisionConfig(hidden_size=settings.vision_width, intermediate_size=2 * settings.vision_width,
                          num_layers=settings.vision_layers, num_heads=settings.vision_heads,
                          head_dim=settings.vision_head_dim, patch_size=settings.patch_size,
                          pos_emb_height=grid, pos_emb_width=grid, text_hidden_size=text.hidden_size)
    return K3ForConditionalGeneration(text, vision, qa.media_token_id)


def processor_for(settings: DemoSettings) -> ImageProcessor:
    """Keeps every picture at its size: the square ones and the wider text ones."""
    qa = SyntheticVQA(size=settings.image_size)
    return ImageProcessor(patch_size=settings.patch_size, max_patches=qa.max_patches(settings.patch_size))


def make_batch(qa: SyntheticVQA, processor: ImageProcessor, samples: list[VQASample]):
    """(ids [B, T], labels [B, T] with -100 off the answer, uint8 patches, grid_thw). labels[t] is the token at
    t + 1 where that token is part of the answer or its <eos>; rows are right-padded."""
    images = processor([s.image for s in samples])
    rows, starts = [], []
    for sample, n in zip(samples, images.tokens_per_image):
        prompt = qa.prompt_ids(sample, n)
        starts.append(len(prompt))
        rows.append(prompt + qa.answer_ids(sample))
    length = max(map(len, rows))
    pad = qa.vocab["<pad>"]
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, starts)):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, start - 1:len(row) - 1] = torch.tensor(row[start:])
    return ids, labels, images.patches, images.grid_thw


@torch.no_grad()
def evaluate(model, qa: SyntheticVQA, processor: ImageProcessor, samples: list[VQASample],
             batch_size: int = 100, bf16: bool = False) -> dict[str, float]:
    """Per kind: the fraction of samples whose every answer token (and <eos>) is the model's argmax."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = {kind: [0, 0] for kind in KINDS}
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        ids, labels, pixels, grid = make_batch(qa, processor, chunk)
        ids, labels = ids.to(device), labels.to(device)
        with _autocast(device, bf16):
            logits = model(ids, processor.pixel_values_on(pixels, device), grid).logits
        hit = (logits.argmax(-1) == labels) | (labels == -100)
        for sample, ok in zip(chunk, hit.all(-1).tolist()):
            correct[sample.kind][0] += int(ok)
            correct[sample.kind][1] += 1
    model.train(was_training)
    return {kind: c / n for kind, (c, n) in correct.items() if n}


@torch.no_grad()
def letter_accuracy(model, qa: SyntheticVQA, processor: ImageProcessor, samples: list[VQASample],
                    bf16: bool = False) -> float | None:
    """For the text kind: the fraction of letters read right (teacher-forced; chance 1/10), a finer measure than
    the exact answer."""
    texts = [s for s in samples if s.kind == "text"]
    if not texts:
        return None
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    right = total = 0
    for start in range(0, len(texts), 100):
        ids, labels, pixels, grid = make_batch(qa, processor, texts[start:start + 100])
        ids, labels = ids.to(device), labels.to(device)
        with _autocast(device, bf16):
            predicted = model(ids, processor.pixel_values_on(pixels, device), grid).logits.argmax(-1)
        letters = (labels != -100) & (labels != qa.vocab["<eos>"])
        right += int((predicted == labels)[letters].sum())
        total += int(letters.sum())
    model.train(was_training)
    return right / total


def _autocast(device: torch.device, bf16: bool):
    """bf16 autocast over fp32 weights on CUDA (as k3 train does); plain fp32 elsewhere."""
    if bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def answer_loss(logits: torch.Tensor, labels: torch.Tensor, per: str = "sample") -> torch.Tensor:
    """Cross-entropy of the answer tokens. per="sample": each row's tokens averaged, then the rows, so a question
    counts once whatever its answer's length (a text answer has 4 tokens, the others 2); per="token": every
    answer token counts once (text answers then carry about half the gradient)."""
    token_loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                                   reduction="none")  # [B, T], 0 where ignored
    if per == "token":
        return token_loss.sum() / (labels != -100).sum()
    return (token_loss.sum(1) / (labels != -100).sum(1)).mean()


def cpu_seconds() -> float:
    """User + system CPU time of this process (a load-independent measure on a shared machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_cycle(step: int, total: int, warmup: float = 0.1) -> float:
    """Learning-rate factor: linear warm-up, then cosine from 1 to 0.01."""
    warm = max(1, int(total * warmup))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * progress))


def step_flops(model: K3ForConditionalGeneration, tokens: int, patches: int) -> float:
    """Training FLOPs of one step: 6 x parameters x what they see. The text model's active parameters (without
    the embedding table, top-k of the routed experts) see every token, the tower's every patch, the projector's
    every merged token (patches / 4); attention's quadratic part is left out (sequences of tens of tokens)."""
    from k3.model import count_parameters

    active = count_parameters(model.language_model.config)["active_params"]  # LM head in, embeddings out
    tower = sum(p.numel() for p in model.vision.vision_tower.parameters())
    projector = sum(p.numel() for p in model.vision.mm_projector.parameters())
    return 6.0 * (active * tokens + tower * patches + projector * patches / model.vision_config.merge_area)


def run_demo(settings: DemoSettings, out: str | Path | None = None, progress: bool = True,
             log=print) -> dict:
    """Train, evaluate before and after, and (with `out`) write report.json, curve.png and the model."""
    from tqdm import tqdm

    if out is not None:
        check_out(Path(out))  # before the minutes of training, not after them
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    torch.manual_seed(settings.seed)
    cpu_start, wall_start = cpu_seconds(), time.perf_counter()
    qa = SyntheticVQA(size=settings.image_size, seed=settings.seed)
    processor = processor_for(settings)
    model = build_model(settings, qa).to(device)
    bf16 = settings.dtype == "bf16"
    held_out = qa.samples(settings.eval_count, seed=settings.seed + 1000, kinds=settings.kinds)
    curve_set = held_out[: max(len(settings.kinds), len(held_out) // 4)]
    chance = SyntheticVQA.chance(held_out)
    before = evaluate(model, qa, processor, held_out, bf16=bf16)
    letters_before = letter_accuracy(model, qa, processor, held_out, bf16=bf16)

    vision_params = list(model.vision.parameters())
    text_params = list(model.language_model.parameters())
    groups = [{"params": text_params, "lr": settings.lr},
              {"params": vision_params, "lr": settings.vision_lr or settings.lr}]
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, weight_decay=settings.weight_decay,
                                  fused=device.type == "cuda")
    peaks = [g["lr"] for g in optimizer.param_groups]
    train = qa.stream(settings.seed, settings.kinds)
    curve = [{"step": 0, **evaluate(model, qa, processor, curve_set, bf16=bf16)}]
    losses: list[float] = []
    train_seconds, images_seen, patches_seen, tokens_seen = 0.0, 0, 0, 0
    model.train()
    loop_started = time.perf_counter()
    for step in tqdm(range(settings.steps), desc="vqa demo", disable=not progress):
        batch = [next(train) for _ in range(settings.batch_size)]
        ids, labels, pixels, grid = make_batch(qa, processor, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        ids, labels = ids.to(device, non_blocking=True), labels.to(device)
        pixels = processor.pixel_values_on(pixels, device)
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * _one_cycle(step, settings.steps)
        with _autocast(device, bf16):
            logits = model(ids, pixels, grid).logits
        loss = answer_loss(logits, labels, settings.loss_per)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= min(5, settings.steps // 10):  # leave out the first steps (allocator, kernel selection)
            train_seconds += time.perf_counter() - started
            images_seen += len(batch)
            patches_seen += pixels.shape[0]
            tokens_seen += ids.numel()
        losses.append(loss.item())
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            curve.append({"step": step + 1, **evaluate(model, qa, processor, curve_set, bf16=bf16)})
            if not progress:
                log(f"step {step + 1}: loss {sum(losses[-20:]) / len(losses[-20:]):.3f}  "
                    + "  ".join(f"{k} {v:.2f}" for k, v in curve[-1].items() if k != "step"))
    loop_seconds = time.perf_counter() - loop_started  # with picture generation and the curve's evaluations
    after = evaluate(model, qa, processor, held_out, bf16=bf16)
    report = {
        "settings": dataclasses.asdict(settings),
        "kinds": list(settings.kinds),
        "eval_count": len(held_out),
        "before": before,
        "after": after,
        "chance": {k: chance[k]["uniform"] for k in settings.kinds},
        "majority": {k: chance[k]["majority"] for k in settings.kinds},
        "text_letters": {"before": letters_before,
                         "after": letter_accuracy(model, qa, processor, held_out, bf16=bf16)},
        "first_loss": losses[0],
        "last_loss": sum(losses[-20:]) / len(losses[-20:]),
        "curve": curve,
        "cpu_seconds": cpu_seconds() - cpu_start,
        "wall_seconds": time.perf_counter() - wall_start,
        "train_images_per_second": images_seen / train_seconds if train_seconds else None,  # the step alone
        "parameters": {"text": sum(p.numel() for p in text_params), "vision": sum(p.numel() for p in vision_params)},
    }
    report["images_per_second_end_to_end"] = settings.steps * settings.batch_size / loop_seconds
    if device.type == "cuda" and train_seconds:
        flops = step_flops(model, tokens_seen, patches_seen)
        report["train_tflops"] = flops / train_seconds / 1e12
        report["mfu"] = flops / train_seconds / GPU_BF16_PEAK_FLOPS
        report["device_name"] = torch.cuda.get_device_name(device)
    if out is not None:
        write_outputs(model, qa, report, Path(out))
    return report


def check_out(out: Path) -> None:
    """The demo writes into a new or empty folder, or over its own earlier outputs, never into another's files."""
    if not out.exists():
        return
    own = all((out / name).is_file() for name in ("report.json", "curve.png"))
    if out.is_dir() and (own or not any(out.iterdir())):
        return
    raise ValueError(f"{out} exists and does not hold an earlier `k3 vision demo`'s outputs; choose another --out")


def write_outputs(model: K3ForConditionalGeneration, qa: SyntheticVQA, report: dict, out: Path) -> None:
    """The model and tokenizer in the published K3 layout (k3 eval --run / --model reads it), report.json,
    curve.png."""
    from k3.checkpoint.hf_multimodal import save_pretrained
    from k3.checkpoint.native import atomic_write_bytes

    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model.to("cpu").float(), qa.tokenizer(), out, progress=False)
    atomic_write_bytes(out / "report.json", json.dumps(report, indent=1).encode())
    plot_curve(report, out / "curve.png")


def plot_curve(report: dict, path: Path) -> None:
    """Held-out accuracy per kind against training steps, chance dotted in the same colour."""
    from k3.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [point["step"] for point in report["curve"]]
    for i, kind in enumerate(report["kinds"]):
        colour = f"C{i}"
        ax.plot(steps, [point[kind] for point in report["curve"]], marker=".", color=colour, label=kind)
        ax.axhline(report["chance"][kind], color=colour, linestyle=":", linewidth=1)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (exact answer)")
    ax.set_title("synthetic visual QA: accuracy per question kind (dotted: chance)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)


def summary_table(report: dict) -> str:
    lines = [f"{'kind':<10} {'chance':>7} {'before':>7} {'after':>7}"]
    for kind in report["kinds"]:
        lines.append(f"{kind:<10} {report['chance'][kind]:>7.3f} {report['before'][kind]:>7.3f} "
                     f"{report['after'][kind]:>7.3f}")
    letters = report.get("text_letters", {})
    if letters.get("after") is not None:
        lines.append(f"{'letters':<10} {0.1:>7.3f} {letters['before']:>7.3f} {letters['after']:>7.3f}  (text, each "
                     f"letter)")
    return "\n".join(lines)
