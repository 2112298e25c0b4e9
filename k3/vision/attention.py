"""Bidirectional attention isolated per image (or per video clip: all its frames attend to each other).

Two paths, picked by name:
- "sdpa": one torch scaled_dot_product_attention call per image. Plain PyTorch, runs anywhere; the oracle.
- "varlen": one flash-attention call over the whole pack with cu_seqlens (torch.nn.attention.varlen), CUDA
  with fp16/bf16 only. Held equal to "sdpa" by tests/vision/test_attention_cuda.py.
"auto" takes "varlen" where it can run and the pack holds more than AUTO_VARLEN_MIN_IMAGES images, else "sdpa".
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "sdpa", "varlen")
AUTO_VARLEN_MIN_IMAGES = 8  # "auto" takes varlen for packs of more images than this


def cu_seqlens_from_grid(grid_thw: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """[num_images + 1] int32 starts of each image's patches in the pack, plus the total."""
    lengths = grid_thw.prod(dim=-1).to(torch.int32)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=grid_thw.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu.to(device) if device is not None else cu


def _varlen_available(q: torch.Tensor) -> bool:
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8:
        return False
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None  # torch >= 2.9


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     backend: str = "auto", bounds: list[int] | None = None) -> torch.Tensor:
    """q, k, v [N, H, D] packed images; cu_seqlens [n + 1] -> [N, H, D]. Softmax scale 1/sqrt(D).
    bounds: cu_seqlens as Python ints, when the caller has them (else read from cu_seqlens: a sync on a GPU)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "varlen" and not _varlen_available(q):
        raise ValueError(f"the 'varlen' attention backend needs CUDA, fp16/bf16 and head_dim % 8 == 0 "
                         f"(got {q.device.type}, {q.dtype}, head_dim {q.shape[-1]}); use 'sdpa' or 'auto'")
    # auto: measured on one H200 (bench/vision.py), the single varlen call wins on packs of many images
    # (128 x 224 px: 1.2-1.7x) and per-image SDPA on a few large ones (8 x 896 px: 1.2x); 32 x 448 px is even.
    many_images = len(cu_seqlens) - 1 > AUTO_VARLEN_MIN_IMAGES
    if backend == "varlen" or (backend == "auto" and many_images and _varlen_available(q)):
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if bounds is None:
            bounds = cu_seqlens.tolist()
        longest = max((end - start for start, end in zip(bounds[:-1], bounds[1:])), default=0)
        return varlen_attn(q, k, v, cu, cu, longest, longest)
    if bounds is None:
        bounds = cu_seqlens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # [1, H, L, D]: heads as the batch dims SDPA expects
        segment = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        outputs.append(F.scaled_dot_product_attention(*segment).squeeze(0).transpose(0, 1))
    return torch.cat(outputs) if outputs else torch.empty_like(q)
