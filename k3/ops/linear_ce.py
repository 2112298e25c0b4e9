"""The LM head and cross-entropy as one op, so a training step need not hold [tokens, vocab] logits.

    loss = mean over labels != ignore_index of ( logsumexp(h W^T) - (h W^T)[label] ),  logits in fp32

Four interchangeable paths, held equal by tests/ops/test_linear_ce.py (K3_LINEAR_CE picks one; `auto`, the
default, takes `fused` for CUDA tensors when fla imports and `torch` elsewhere):
- `torch` (old name `plain`): F.linear then F.cross_entropy on fp32 logits, what K3ForCausalLM always did. A `small` step at
  4 x 4096 tokens holds bf16 logits, their fp32 copy and its gradient: 16K x 32K x 10 bytes = 5.4 GB, and its
  casts, log-softmax and their backwards are six passes over [tokens, vocab] (6.4 ms of a 177 ms `small` step on
  one H200, besides the head's GEMMs).
- `fused`: F.linear to bf16 logits, then fla's Triton cross-entropy over them (fp32 arithmetic inside, one
  read in the forward) whose backward writes the logits' gradient over the logits in place: no fp32 copy, two
  passes. Same GEMMs as plain; the logits are the op's own, so nothing else reads them after the overwrite.
- `chunked`: rows in chunks; each chunk's logits live only inside the forward, which also forms that chunk's
  gradients for h and W (softmax - one-hot), so backward is a scale. Peak extra memory is one chunk's fp32
  logits, and the same GEMMs run (one forward, two gradient GEMMs per chunk).
- `fla`: fla's fused_linear_cross_entropy_loss (Triton logsumexp and in-place gradient kernels; CUDA only).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from k3 import kernels

BACKENDS = kernels.SWITCHES["linear_ce"].choices
CHUNK_ROWS = 4096


def linear_cross_entropy_plain(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
    """hidden [N, D], weight [V, D], labels [N] -> mean cross-entropy (the oracle)."""
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=ignore_index)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk_rows: int):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        valid = labels != ignore_index
        for start in range(0, hidden.shape[0], chunk_rows):
            h, y, keep = (t[start:start + chunk_rows] for t in (hidden, labels, valid))
            logits = F.linear(h, weight).float()  # [c, V], the only full-width tensor, freed per chunk
            target = torch.where(keep, y, 0).unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, target).squeeze(1)) * keep).sum()
            if want_h or want_w:
                # d(sum of losses) / d logits = softmax - one_hot(label), zero on ignored rows.
                grad = torch.exp(logits.sub_(lse.unsqueeze(1)))
                grad.scatter_add_(1, target, torch.full_like(target, -1, dtype=grad.dtype))
                grad = grad.mul_(keep.unsqueeze(1)).to(hidden.dtype)
                if want_h:
                    grad_h[start:start + chunk_rows] = grad @ weight.to(hidden.dtype)
                if want_w:
                    grad_w += (grad.t() @ h).float()
        count = valid.sum()
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None), count)
        ctx.wanted = (want_h, want_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        *grads, count = ctx.saved_tensors
        scale = grad_loss / count
        grads = iter(grads)
        grad_h, grad_w = ((next(grads) * scale).to(dtype) if wanted else None
                          for wanted, dtype in zip(ctx.wanted, ctx.dtypes))
        return grad_h, grad_w, None, None, None


def linear_cross_entropy_chunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 ignore_index: int = -100, chunk_rows: int | None = None) -> torch.Tensor:
    """The same loss and gradients as linear_cross_entropy_plain, never holding more than `chunk_rows` rows of
    logits (default CHUNK_ROWS)."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_rows or CHUNK_ROWS)


def linear_cross_entropy_fla(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100) -> torch.Tensor:
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

    return fused_linear_cross_entropy_loss(hidden, labels, weight, ignore_index=ignore_index)


@functools.lru_cache(maxsize=1)
def _load_fla_cross_entropy():
    """fla's cross_entropy_loss, or the import error as text; imported once, lazily (pulls triton)."""
    try:
        from fla.modules.fused_cross_entropy import cross_entropy_loss
    except Exception as exc:  # absent, or present without a usable Triton: a broken install raises more
        return f"{type(exc).__name__}: {exc}"
    return cross_entropy_loss


def _fla_importable() -> bool:
    return not isinstance(_load_fla_cross_entropy(), str)


def linear_cross_entropy_fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100) -> torch.Tensor:
    """The plain path's loss and gradients with fla's cross-entropy kernels on the logits (CUDA only); the
    logits' gradient overwrites them in place."""
    cross_entropy_loss = _load_fla_cross_entropy()
    if isinstance(cross_entropy_loss, str):
        raise RuntimeError(f"fla's cross_entropy_loss is not importable ({cross_entropy_loss})")
    loss_N, _ = cross_entropy_loss(F.linear(hidden, weight), labels, ignore_index=ignore_index,
                                   inplace_backward=True)
    # F.cross_entropy's mean: over the rows that count (ignored rows' losses are zero), NaN when none does.
    return loss_N.sum() / (labels != ignore_index).sum()


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor, without importing torch.distributed.tensor (~0.9 s of `import k3.model`) where
    nothing has: a DTensor exists only once that module is loaded (FSDP and torch.compile load it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def linear_cross_entropy_backend(on_cuda: bool = False) -> str:
    """The path K3_LINEAR_CE names, with `auto` resolved for tensors on CUDA (`on_cuda`) or not."""
    backend = kernels.choice("linear_ce")
    if backend == "auto":
        return "fused" if on_cuda and _fla_importable() else "torch"
    return backend


def linear_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """hidden [..., D], head: the LM head (weight [V, D], no bias), labels [...] -> mean cross-entropy over
    labels != ignore_index, by the K3_LINEAR_CE path (`fla` needs CUDA tensors and falls back to `chunked`
    elsewhere, `fused` falls back to `plain`). A head sharded by FSDP (a DTensor weight, gathered only by the
    module's own forward hook) takes the plain path through the module."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    backend = linear_cross_entropy_backend(hidden.is_cuda)
    weight = head.weight
    if backend == "torch" or is_dtensor(weight) or (backend == "fused" and not hidden.is_cuda):
        return F.cross_entropy(head(hidden).float(), labels, ignore_index=ignore_index)
    if backend == "fused":
        return linear_cross_entropy_fused(hidden, weight, labels, ignore_index)
    if backend == "fla" and hidden.is_cuda:
        return linear_cross_entropy_fla(hidden, weight, labels, ignore_index)
    return linear_cross_entropy_chunked(hidden, weight, labels, ignore_index)
