"""Host-side work of an image-text `k3 train` step, counted on the CPU: torch ops dispatched (forward, backward,
optimizer) and host reads (item / tolist / cpu / nonzero / bool / int / float of a tensor: each a sync on a GPU
when the tensor lives there), per step and as the images per step vary; plus the step's wall time (the CPU runs
the math too, so the time is only a rough guide to the host's share). The tower's attention is counted as one
call forward and one backward, as the GPU's varlen flash call over the pack (the CPU runs per-image SDPA).

    python bench/vision_host_ops.py --out DIR [--json]

Rows: the `debug` text preset with the `tiny` tower, 256-token rows of synthetic VQA pictures of 56-112 px;
--rows sets the image rows a step (more rows, more images).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import k3.vision.tower as tower  # noqa: E402
from bench.vision_train_gpu import write_data  # noqa: E402

SDPA_LOOP = tower.packed_attention

HOST_READS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "numpy"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not self.paused
        return func(*args, **(kwargs or {}))


COUNTER: list[OpCounter] = []  # the active counter, for the varlen stand-in


class OneCallAttention(torch.autograd.Function):
    """The per-image SDPA loop counted as one op forward and one backward: what the GPU's single varlen flash
    call over the pack costs the host (the CPU has no varlen kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, bounds):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.bounds = bounds
        with _paused():
            return SDPA_LOOP(q, k, v, cu_seqlens, "sdpa", *([bounds] if bounds is not None else []))

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_seqlens = ctx.saved_tensors
        with _paused(), torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = SDPA_LOOP(*inputs, cu_seqlens, "sdpa", *([ctx.bounds] if ctx.bounds is not None else []))
            grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None, None)


class _paused:
    def __enter__(self):
        if COUNTER:
            COUNTER[0].paused = True
            COUNTER[0].ops += 1

    def __exit__(self, *exc):
        if COUNTER:
            COUNTER[0].paused = False


def one_call_attention(q, k, v, cu_seqlens, backend="auto", bounds=None):
    return OneCallAttention.apply(q, k, v, cu_seqlens, bounds)


class HostReadCounter(TorchFunctionMode):
    """Counts host reads of tensors, by the k3 line that asked."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            stack = traceback.extract_stack(limit=12)[:-1]
            frame = next((f for f in reversed(stack) if "/k3/" in f.filename), None)
            where = f"{frame.filename.split('/k3/')[-1]}:{frame.lineno}" if frame else "outside k3"
            inside_torch = "/k3/" not in stack[-1].filename  # torch's own (e.g. clip_grad_norm_'s CPU path)
            self.sites[f"{name} @ {where}" + (" (inside torch)" if inside_torch else "")] += 1
        return func(*args, **(kwargs or {}))


def build(out: Path, rows: int):
    from k3.train.trainer import TrainConfig, Trainer

    data = write_data(out / "data", [56, 84, 112], 8)
    build_config = getattr(TrainConfig, "flat", TrainConfig)
    config = build_config(preset="debug", out=str(out / f"run{rows}"), data=[str(data)],
                          tokenizer=str(out / "data" / "tokenizer"), image_fraction=1.0, vision="tiny", seq_len=256,
                          batch_size=rows, max_steps=100, lr=3e-4, warmup_steps=5, eval_every=10**6,
                          save_every=10**6, val_fraction=0.02, max_corpus_mb=1.0, recall_fraction=0.0, device="cpu",
                          max_documents_per_row=32)  # room for every image row's examples (~16 at 256 tokens)
    return Trainer(config, show_progress=False, log=lambda _: None)


def measure(out: Path, rows: int, steps: int, gpu_form: bool) -> dict:
    torch.manual_seed(0)
    tower.packed_attention = one_call_attention
    trainer = build(out, rows)
    if gpu_form and hasattr(trainer, "static_image_documents"):
        trainer.static_image_documents = True  # the document form a GPU step takes
    trainer._train_step()  # warm: caches, lazy inits
    images, ops, reads, seconds = 0, 0, collections.Counter(), []
    for _ in range(steps):
        draw = trainer._next_batch
        batch, _ = draw()
        images += batch.grid_thw.shape[0]
        trainer._next_batch = lambda b=batch: (b, b.num_tokens)
        ops_mode, read_mode = OpCounter(), HostReadCounter()
        COUNTER[:] = [ops_mode]
        with read_mode, ops_mode:
            trainer._train_step()
        COUNTER.clear()
        trainer._next_batch = draw
        ops += ops_mode.ops
        reads.update(read_mode.sites)
    for _ in range(steps):  # timing apart from the counting modes' own overhead
        t0 = time.perf_counter()
        trainer._train_step()
        seconds.append(time.perf_counter() - t0)
    return {"rows": rows, "images_per_step": images / steps, "ops_per_step": ops / steps,
            "host_reads_per_step": sum(v for k, v in reads.items() if "inside torch" not in k) / steps,
            "host_reads_inside_torch_per_step": sum(v for k, v in reads.items() if "inside torch" in k) / steps,
            "host_reads_by_site": {k: v / steps for k, v in reads.most_common()},
            "static_documents": getattr(trainer, "static_image_documents", False),
            "step_ms_median": 1e3 * sorted(seconds)[len(seconds) // 2]}


def measure_tower(images: int) -> dict:
    """The K3 tower (tiny sizes) and projector alone, forward and backward, over a pack of `images` images of
    2x2, 4x4 and 6x6 patches in turn (small, so that the time is mostly the host's): what of the step's host
    work scales with the images."""
    from k3.vision import VisionConfig, VisionModel

    torch.manual_seed(0)
    tower.packed_attention = one_call_attention
    vision = VisionModel(VisionConfig.from_preset("tiny", text_hidden_size=64)).train()
    grids = [[1, side, side] for side in [2, 4, 6] * images][:images]
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), 3, 14, 14)
    vision(pixels, grid_thw).sum().backward()  # warm
    ops_mode, read_mode = OpCounter(), HostReadCounter()
    COUNTER[:] = [ops_mode]
    with read_mode, ops_mode:
        vision(pixels, grid_thw).sum().backward()
    COUNTER.clear()
    seconds = []
    for _ in range(15):
        t0 = time.perf_counter()
        vision(pixels, grid_thw).sum().backward()
        seconds.append(time.perf_counter() - t0)
    return {"images": images, "ops": ops_mode.ops, "host_reads": sum(read_mode.sites.values()),
            "forward_backward_ms_median": 1e3 * sorted(seconds)[len(seconds) // 2],
            "host_reads_by_site": dict(read_mode.sites)}


def measure_documents(documents: int, length: int = 1024) -> dict:
    """The `debug` language model alone, forward and backward over one packed row of `documents` equal
    documents: an image row holds one document per example (one to a few images each), so this is what of the
    step's host work scales with the examples on the text side."""
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).train()
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    cu = torch.linspace(0, length, documents + 1).long()
    model(ids, cu_seqlens=cu, labels=ids, return_logits=False).loss.backward()  # warm
    ops_mode, read_mode = OpCounter(), HostReadCounter()
    with read_mode, ops_mode:
        model(ids, cu_seqlens=cu, labels=ids, return_logits=False).loss.backward()
    return {"documents": documents, "lm_ops": ops_mode.ops, "lm_host_reads": sum(read_mode.sites.values()),
            "lm_host_reads_by_site": dict(read_mode.sites)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cpu-form", action="store_true",
                        help="the language model's per-document form, as a CPU run takes (default: a GPU run's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    towers = [measure_tower(n) for n in (6, 30)]
    towers[1]["ops_per_extra_image"] = (towers[1]["ops"] - towers[0]["ops"]) / 24
    towers[1]["host_reads_per_extra_image"] = (towers[1]["host_reads"] - towers[0]["host_reads"]) / 24
    documents = [measure_documents(n) for n in (4, 32)]
    documents[1]["lm_ops_per_extra_document"] = (documents[1]["lm_ops"] - documents[0]["lm_ops"]) / 28
    results = towers + documents + [measure(out, rows, args.steps, not args.cpu_form) for rows in args.rows]
    if len(args.rows) >= 2:  # what one more image row costs (its text tokens too)
        a, b = results[4], results[-1]
        extra = b["images_per_step"] - a["images_per_step"]
        for key in ("ops_per_step", "host_reads_per_step"):
            b[key.replace("per_step", "per_extra_image")] = (b[key] - a[key]) / extra if extra else None
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(json.dumps({k: v for k, v in r.items() if "by_site" not in k}))
            for site, count in r.get("host_reads_by_site", r.get("lm_host_reads_by_site", {})).items():
                if "inside torch" in site:
                    continue
                print(f"    {count:7.1f}  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
