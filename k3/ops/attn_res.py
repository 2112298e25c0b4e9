"""The Attention-Residual mix over depth: one eager PyTorch path, Triton kernels, and a compiled (fused) twin.

    mix = sum_i alpha_i v_i,   alpha = softmax_i( (v_i . q) / rms(v_i) ),   q = norm_weight * pseudo_query

Eager, this materialises the stacked sources [S, B, T, D] in fp32 several times over (stack, upcast, keys,
weighted values); it is the CPU default and the twin the others are tested against. The mix is memory-bound, so
on CUDA it runs as two hand-written Triton kernels (k3.ops.attn_res_triton: forward and backward, each source
read in place, the result written once in the sources' dtype). The compiled path is the eager function handed
to torch.compile over a torch.stack of the sources: fused, but at `small`'s training shape on one H200 (16,384
tokens, D 1024, 2-5 sources; bench/attn_res.py) a mix took 0.81-1.82 ms forward + backward, 12.6-13.3x its memory
floor (Inductor's kernels under the unbacked token dimension, the fp32 output and the stack), against 0.13-0.29 ms
for the kernels. It stays, forced, for comparison and as a fallback.

Backend: the k3.kernels switch `attn_res` (K3_ATTN_RES_BACKEND, `set_attn_res_backend`): "auto" (triton for CUDA
tensors in fp32/bf16/fp16 when triton imports, compiled for other CUDA tensors, the eager formula otherwise);
"torch" (the eager formula; "eager" is its old name), "compiled" and "triton" force one ("triton" on CPU tensors needs TRITON_INTERPRET=1, Triton's
CPU interpreter, as in the tests). Inside a torch.compile'd caller every backend traces the eager form into the
caller's graph.
Shape legend: S sources, B batch, T tokens, D hidden.
"""

from __future__ import annotations

import functools

import torch

from k3 import kernels
from k3.ops.attn_res_triton import DTYPES as TRITON_DTYPES
from k3.ops.attn_res_triton import MAX_SOURCES as TRITON_MAX_SOURCES
from k3.ops.attn_res_triton import FinishedSources, attn_res_mix_triton
from k3.ops.fused_backend import with_torch_fallback
from k3.ops.triton_support import interpreting, triton_importable



def _mix_stacked(values_SND: torch.Tensor, norm_weight_D: torch.Tensor, query_D: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """values_SND: the S sources stacked, tokens on any leading dims ([S, N, D] or [S, B, T, D])."""
    compute = torch.promote_types(values_SND.dtype, torch.float32)
    values_SND = values_SND.to(compute)
    inv_rms_SN = torch.rsqrt(values_SND.pow(2).mean(-1) + eps)
    q_D = (norm_weight_D.to(compute) * query_D.to(compute))
    alpha_SN = torch.softmax((values_SND @ q_D) * inv_rms_SN, dim=0)
    return (alpha_SN.unsqueeze(-1) * values_SND).sum(0)


def attn_res_mix_eager(sources: list[torch.Tensor], norm_weight_D: torch.Tensor, query_D: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """sources: S tensors [B, T, D]; norm_weight_D, query_D: [D]. Returns the mix [B, T, D] in the sources'
    dtype, computed in fp32 (fp64 stays fp64)."""
    return _mix_stacked(torch.stack(sources, dim=0), norm_weight_D, query_D, eps).to(sources[0].dtype)


@functools.lru_cache(maxsize=1)
def _compiled():
    # One graph must serve every source count (2..blocks+1; one source never reaches the op), batch and
    # length, prefill and one-token decode: specialising per shape hit dynamo's recompile limit in decode,
    # and each new graph is an Inductor compile of tens of seconds. See _stack_tokens for the token count.
    return torch.compile(_mix_stacked, dynamic=True, fullgraph=True)


def _stack_tokens(sources: list[torch.Tensor]) -> torch.Tensor:
    """[S, N, D] with N = B*T, a fresh tensor (a view of a stack would put its base's strides in the guards).
    Even dynamic, dynamo specialises a size that is 1 the first time it sees it, so B=1 or T=1 (decode)
    would each cost a graph; N is marked unbacked, which dynamo never specialises."""
    from torch._dynamo.decorators import mark_unbacked  # here: dynamo takes ~1.5 s to import, only compiling needs it

    stacked = torch.stack([s.reshape(-1, s.shape[-1]) for s in sources], dim=0)
    mark_unbacked(stacked, 1)
    return stacked


def set_attn_res_backend(name: str | None) -> None:
    """Pin "auto", "torch" (the eager formula; `eager` is its old name), "compiled" or "triton" (k3.kernels.pin);
    None goes back to K3_ATTN_RES_BACKEND (default "auto")."""
    kernels.pin("attn_res", name)


def attn_res_backend(x: torch.Tensor | None = None) -> str:
    """The configured backend, or with x the path a call on x would take ("torch", "compiled" or "triton")."""
    name = kernels.choice("attn_res")
    if x is None or name != "auto":
        return name
    if not x.is_cuda:
        return "torch"
    return "triton" if x.dtype in TRITON_DTYPES and triton_importable() else "compiled"


def attn_res_mix(sources: list[torch.Tensor], norm_weight_D: torch.Tensor, query_D: torch.Tensor,
                 eps: float, finished: FinishedSources | None = None) -> torch.Tensor:
    """Dispatching entry point; same arguments and result as attn_res_mix_eager. Inside a torch.compile'd
    caller (a compiled decode step) the eager form is traced into the caller's graph and fused there.
    `finished` (an AttnResStream's registered sources) lets the Triton backward sum their gradients in place;
    the other paths take the sources as they are."""
    if torch.compiler.is_compiling():
        return attn_res_mix_eager(sources, norm_weight_D, query_D, eps)
    backend = attn_res_backend(sources[0])
    if backend == "torch":
        return attn_res_mix_eager(sources, norm_weight_D, query_D, eps)
    if backend == "triton":
        sources = _common_dtype(sources)
        if not sources[0].is_cuda and not interpreting():
            raise ValueError("the triton AttnRes backend runs CPU tensors only in Triton's interpreter "
                             "(TRITON_INTERPRET=1); use the eager backend for them")
        if attn_res_backend() != "auto":
            return attn_res_mix_triton(sources, norm_weight_D, query_D, eps, finished=finished)
        if len(sources) > TRITON_MAX_SOURCES:  # see MAX_SOURCES
            return attn_res_mix_compiled(sources, norm_weight_D, query_D, eps)
        # Chosen, not forced: a kernel variant Triton cannot compile here runs the twin from then on.
        variant = ("attn_res_triton", len(sources), sources[0].shape[-1], sources[0].dtype)
        return with_torch_fallback(variant, lambda: attn_res_mix_triton(sources, norm_weight_D, query_D, eps,
                                                                        finished=finished),
                                   lambda: attn_res_mix_eager(sources, norm_weight_D, query_D, eps))
    return attn_res_mix_compiled(sources, norm_weight_D, query_D, eps)


def _common_dtype(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sources in one dtype, the one torch.stack promotes them to (the eager path's). Under autocast over
    fp32 weights the embedding (source 0) is fp32 while the layers' outputs are bf16; the kernels read one dtype.
    The mix then comes out in fp32, source 0's dtype, as in the eager path."""
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in sources))
    return [s if s.dtype == dtype else s.to(dtype) for s in sources]


def attn_res_mix_compiled(sources: list[torch.Tensor], norm_weight_D: torch.Tensor, query_D: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """The eager formula through torch.compile over the stacked sources (one graph for every count and length)."""
    mixed_ND = _compiled()(_stack_tokens(sources), norm_weight_D, query_D, eps)
    return mixed_ND.view(sources[0].shape).to(sources[0].dtype)
