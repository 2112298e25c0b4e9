"""Causal attention over packed documents: each query sees its own document's earlier tokens and nothing else.

Two paths, held equal by tests/ops/test_packed_attention.py (and its CUDA twin):
- `packed_attention_masked` (the twin; CPU, fp32, and wherever the other cannot run): the documents' rows as
  [rows, row_length] with a boolean [rows, row_length, row_length] mask through SDPA. Static shapes, no host read
  (the captured training step), but the whole row's scores are computed and a mask of rows * row_length^2 bytes
  is read by every call (64 MiB for `small`'s 4 x 4096 rows), and SDPA takes its memory-efficient kernel for it.
- `packed_attention_varlen`: PyTorch's variable-length flash attention (torch.nn.attention.varlen, FA2) over the
  documents as given by cu_seqlens: each document's causal triangle and nothing else, no mask in memory. The
  static form's zero-length padding documents (k3.model.pad_cu_seqlens) launch blocks that exit at once, and
  max_q is the row length (no document crosses a row), so nothing is read back to the host either.

`K3_PACKED_ATTENTION=auto|torch|varlen` forces one (k3.kernels); auto takes varlen for bf16/fp16 CUDA tensors
when torch has it and the heads fit FA2 (at most 256 wide; q, k and v are zero-padded to one width).

Shapes: q, k [1, total, H, d], v [1, total, H, dv]; total = rows * row_length; returns [1, total, H, dv].
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from k3 import kernels

FLASH_MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """torch.nn.attention.varlen.varlen_attn, or None where this torch has none (before 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=1)
def _causal_keywords() -> dict:
    """How this torch's varlen_attn is told "causal": window_size=(-1, 0) from 2.10 on, is_causal=True in 2.9."""
    parameters = inspect.signature(_varlen_attn()).parameters
    return {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}


def flash_width(q: torch.Tensor, v: torch.Tensor) -> int:
    """The one head width flash attention runs q, k and v at: the wider of the two, a multiple of 8 (MLA's value
    heads are often narrower than its query heads: K3's are 128 against 192)."""
    return -(-max(q.shape[-1], v.shape[-1]) // 8) * 8


def varlen_suits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the flash varlen kernel can take these tensors."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.shape[-1] == q.shape[-1]
            and flash_width(q, v) <= FLASH_MAX_HEAD_DIM and _varlen_attn() is not None)


def packed_attention_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens: torch.Tensor | None) -> str:
    """The path a call on these tensors takes: "varlen" or "torch"."""
    choice = kernels.choice("packed_attention")
    if choice == "torch" or cu_seqlens is None:
        return "torch"
    if choice == "varlen":
        if not varlen_suits(q, k, v):
            raise RuntimeError(f"packed attention 'varlen' forced but it cannot run here (q {tuple(q.shape)} "
                               f"{q.dtype} on {q.device}, v width {v.shape[-1]}; torch has varlen_attn: "
                               f"{_varlen_attn() is not None}); use {kernels.switch('packed_attention').env}=auto")
        return "varlen"
    return "varlen" if varlen_suits(q, k, v) else "torch"


def packed_attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_in_doc: torch.Tensor,
                            row_length: int, scale: float) -> torch.Tensor:
    """The twin: key j is visible to query i iff i - position_in_doc[i] <= j <= i, within each row."""
    length = q.shape[1]
    rows = length // row_length
    i = torch.arange(row_length, device=q.device)
    start_RT = i - position_in_doc.view(rows, row_length)  # each query's document start within its row
    visible_RTS = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] >= start_RT[:, :, None])

    def as_rows(t):  # [1, total, H, d] -> [rows, H, row_length, d]
        return t.reshape(rows, row_length, *t.shape[2:]).transpose(1, 2).to(q.dtype)

    out = F.scaled_dot_product_attention(as_rows(q), as_rows(k), as_rows(v), attn_mask=visible_RTS[:, None],
                                         scale=scale)
    return out.transpose(1, 2).reshape(1, length, out.shape[1], out.shape[-1])


def packed_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_length: int, scale: float) -> torch.Tensor:
    """Flash varlen attention over the documents of cu_seqlens [N+1] (zero-length ones allowed); max_length: the
    longest document's length or any bound on it (a host int: the kernel's grid)."""
    cu = cu_seqlens.to(torch.int32)
    width, value_width = flash_width(q, v), v.shape[-1]

    def widened(t):  # zeros past a head's width change no score and give output columns that are cut off
        t = t[0].to(q.dtype)
        return F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t

    out = _varlen_attn()(widened(q), widened(k), widened(v), cu, cu, max_length, max_length, scale=scale,
                         **_causal_keywords())
    return out[..., :value_width].unsqueeze(0)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_in_doc: torch.Tensor,
                            row_length: int, scale: float, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Documents packed into rows of row_length tokens that no document crosses, given as position_in_doc [T]
    (0 at each start) and, for the varlen path, as cu_seqlens (padded with zero-length documents or not)."""
    if packed_attention_backend(q, k, v, cu_seqlens) == "varlen":
        return packed_attention_varlen(q, k, v, cu_seqlens, row_length, scale)
    return packed_attention_masked(q, k, v, position_in_doc, row_length, scale)
