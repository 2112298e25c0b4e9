"""Depthwise causal short convolution + SiLU (KDA's q/k/v convs): k3's Triton kernels, fla's or PyTorch.

    y_t = silu( sum_j w[:, W-1-j] * x_{t-j} ),  taps never reach before the start of a document,
    the (W-1) inputs before the first token come from `tail` (the decode cache) or are zeros.

The PyTorch twin (k3.layers.conv.ShortConv's own code) transposes to [B, C, T] for a cuDNN depthwise conv and
applies SiLU as a separate kernel; fla's `causal_conv1d` reads [B, T, C] in place (strided views allowed), does
the taps, SiLU and packed-document boundaries in one kernel, and returns the cache state it needs.
Which one runs follows K3_CONV_BACKEND (conv_backend): auto (default), torch, fla or triton.
  auto    k3's own Triton kernels (k3.ops.short_conv_triton) for CUDA calls without a tail (training, prefill from
          empty) outside torch.compile, when Triton imports and K3_FUSED_BACKEND does not say torch; otherwise
          as `fla`. At `small`'s training shape on one H200 fla's kernel took 136 us forward and 345 + 136 us
          backward a call (~7.4 ms of a 150 ms step); short_conv_triton says what the new kernels do instead.
  fla     the behaviour before those kernels: k3.ops.fused_backend (K3_FUSED_BACKEND) picks fla's causal_conv1d
          on CUDA when it imports, PyTorch otherwise.
  torch   short_conv_torch everywhere.
  triton  the Triton kernels wherever they run (CPU tensors under TRITON_INTERPRET=1 too); a call with a tail,
          which they do not take, is an error.

Cache layouts: k3 keeps the last W-1 inputs as a tail [B, W-1, C]; fla keeps a window [N, C, W] whose last W-1
columns are those inputs (column 0 is unused on input and holds the oldest input on output).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3 import kernels
from k3.ops.compile_constant import assume_constant_result
from k3.ops.fused_backend import fused_backend, opaque_under_compile, with_torch_fallback
from k3.ops.short_conv_triton import DTYPES, MAX_WIDTH, short_conv_triton, short_conv_triton_parts
from k3.ops.triton_support import interpreting, triton_importable

_ENV = kernels.SWITCHES["conv"].env


def conv_backend() -> str:
    """K3_CONV_BACKEND: "auto" (its default), "torch", "fla" or "triton"."""
    return kernels.choice("conv")


@functools.lru_cache(maxsize=1)
def _load_fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as exc:  # a broken triton install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return causal_conv1d


@assume_constant_result
def fla_conv_available() -> bool:
    """A constant to torch.compile: traced, the import would break the graph wherever fla is missing."""
    return not isinstance(_load_fla_conv(), str)


def short_conv_torch(x: torch.Tensor, weight_CW: torch.Tensor, tail: torch.Tensor | None = None,
                     position_in_doc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C]; weight [C, W]; tail [B, W-1, C] or None; position_in_doc [T] (0 at each document start)
    for packed input. Returns (silu(conv(x)) [B, T, C], new tail [B, W-1, C])."""
    batch, length, channels = x.shape
    width = weight_CW.shape[1]
    if tail is None:
        tail = x.new_zeros(batch, width - 1, channels)
    full = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
    weight = weight_CW.to(x.dtype)
    if position_in_doc is None:
        y = F.conv1d(full.transpose(1, 2), weight.unsqueeze(1), groups=channels).transpose(1, 2)
    else:
        # Tap j (looking j steps back) is valid only when the token is at least j into its document.
        y = x * weight[:, width - 1]
        for j in range(1, width):
            shifted = full[:, width - 1 - j: width - 1 - j + length]
            valid = (position_in_doc >= j).to(x.dtype).view(1, length, 1)
            y = y + shifted * valid * weight[:, width - 1 - j]
    new_tail = full[:, -(width - 1):] if width > 1 else full[:, :0]
    return F.silu(y), new_tail


def short_conv_step(x: torch.Tensor, weight_CW: torch.Tensor,
                    tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token: x [B, 1, C], tail [B, W-1, C] -> (silu(conv) [B, 1, C], new tail [B, W-1, C]) as plain
    elementwise math with an fp32 sum over the W taps. Compiled decode steps take it: inductor fuses it into one
    or two kernels, where fla's causal_conv1d adds a window pad, a state kernel and a transpose copy around a
    kernel made for long inputs (15 us a call at batch 64 on one H200).

    The W taps are summed as W - 1 explicit additions rather than a sum over a [B, W, C] product, which
    Inductor makes a reduction kernel of its own. Measured on one H200 (`small`, batch 64, BENCHMARKS.md round
    twelve) the compiled step kept a kernel for the sum all the same, its result having three users, and was
    no faster; the one-token step with an in-place cache now takes k3.ops.conv_step_triton instead."""
    full = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W, C]
    weight = weight_CW.float()
    acc = full[:, 0].float() * weight[:, 0]
    for tap in range(1, full.shape[1]):
        acc = acc + full[:, tap].float() * weight[:, tap]
    return F.silu(acc).to(x.dtype)[:, None], full[:, 1:]


def short_conv_fla(x: torch.Tensor, weight_CW: torch.Tensor, tail: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same op through fla's causal_conv1d (CUDA). Packed documents come as cu_seqlens [N+1] (B = 1, no
    tail). Returns (y [B, T, C], new tail [N, W-1, C])."""
    y, final = _fla_conv_call(x, weight_CW.to(x.dtype), _fla_window(tail, x.dtype), cu_seqlens)
    return y, final[:, :, 1:].transpose(1, 2)


def _fla_window(tail: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """k3's tail [B, W-1, C] -> fla's window [B, C, W] (column 0 unused)."""
    return None if tail is None else F.pad(tail.to(dtype).transpose(1, 2), (1, 0)).contiguous()


def _fla_conv_call(x: torch.Tensor, weight_CW: torch.Tensor, state: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    conv = _load_fla_conv()
    if isinstance(conv, str):
        raise RuntimeError(f"fla's causal_conv1d is not importable ({conv})")
    return conv(x, weight=weight_CW, initial_state=state, output_final_state=True, activation="silu",
                cu_seqlens=cu_seqlens)


@torch.library.custom_op("k3::fla_causal_conv1d", mutates_args=())
def fla_causal_conv1d_op(x: torch.Tensor, weight_CW: torch.Tensor,
                         state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's causal_conv1d + SiLU for one unpacked batch, opaque to torch.compile: x [B, T, C], weight [C, W]
    (x's dtype), state: fla's window [B, C, W] or None -> (y [B, T, C], final window [B, C, W]), both
    contiguous in x's dtype. The PyTorch twin stands in when Triton cannot compile the kernel."""
    def torch_call():
        tail = None if state is None else state[:, :, 1:].transpose(1, 2)
        y, new_tail = short_conv_torch(x, weight_CW, tail)
        return y.contiguous(), F.pad(new_tail.transpose(1, 2), (1, 0)).contiguous()

    variant = ("short_conv", x.dtype, state is not None, False, x.shape[0] > 1)
    return with_torch_fallback(variant, lambda: _fla_conv_call(x, weight_CW, state, None), torch_call)


@fla_causal_conv1d_op.register_fake
def _(x, weight_CW, state):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], x.shape[2], weight_CW.shape[1])


def _uses_triton(x: torch.Tensor, weight_CW: torch.Tensor, tail: torch.Tensor | None) -> bool:
    """Whether this call takes k3's Triton kernels (module docstring): forced, they must be able to run."""
    backend = conv_backend()
    if backend == "triton":
        if tail is not None:
            raise ValueError(f"{_ENV}=triton: the Triton conv kernels take no cached tail, got tail "
                             f"{tuple(tail.shape)}; use {_ENV}=auto (fla or PyTorch for calls with a tail)")
        if not triton_importable() or not (x.is_cuda or interpreting()):
            raise RuntimeError(f"{_ENV}=triton, but Triton cannot run on {x.device} (needs an importable triton "
                               "and a CUDA tensor, or TRITON_INTERPRET=1 on the CPU); use auto or torch")
        return True
    return (backend == "auto" and tail is None and x.is_cuda and not torch.compiler.is_compiling()
            and fused_backend() != "torch" and x.dtype in DTYPES and weight_CW.dtype in DTYPES
            and weight_CW.shape[-1] <= MAX_WIDTH and (x.stride(2) == 1 or x.shape[2] == 1) and triton_importable())


def _tail_of(x: torch.Tensor, width: int) -> torch.Tensor:
    """short_conv_torch's new tail without a tail in: x's last W-1 times [B, W-1, C], zeros in front when
    T < W-1 (a view of x when T >= W-1: no kernel in training, where nothing reads it)."""
    batch, length, channels = x.shape
    if length >= width - 1:
        return x[:, length - (width - 1):]
    return torch.cat([x.new_zeros(batch, width - 1 - length, channels), x], dim=1)


def short_conv(x: torch.Tensor, weight_CW: torch.Tensor, tail: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None,
               position_in_doc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C], weight [C, W], tail [B, W-1, C] or None, packed documents (B = 1) by cu_seqlens [N+1] and/or
    position_in_doc [T] -> (y [B, T, C], new tail). The path follows K3_CONV_BACKEND (module docstring): fla
    for packed input needs cu_seqlens and no tail, PyTorch takes packed input by position_in_doc.

    The new tail is [B, W-1, C], the row's last W-1 inputs, except from fla's kernel on packed input, which
    returns one per document, [N, W-1, C]. The Triton path keeps short_conv_torch's form for packed input too
    ([1, W-1, C]): packed calls never carry a cache, so nothing reads it."""
    packed = cu_seqlens is not None or position_in_doc is not None
    if _uses_triton(x, weight_CW, tail):
        y = short_conv_triton(x, weight_CW, cu_seqlens=cu_seqlens, position_in_doc=position_in_doc)
        return y, _tail_of(x, weight_CW.shape[-1])
    if conv_backend() == "torch":
        return _short_conv_torch_packed(x, weight_CW, tail, cu_seqlens, position_in_doc)
    fla_ok = (fused_backend(x, available=fla_conv_available()) == "fla"
              and not (packed and (cu_seqlens is None or tail is not None)))

    def torch_call():
        return _short_conv_torch_packed(x, weight_CW, tail, cu_seqlens, position_in_doc)

    if tail is not None and x.shape[1] == 1 and not packed and torch.compiler.is_compiling():
        return short_conv_step(x, weight_CW, tail)
    if fla_ok and not packed and opaque_under_compile(x, weight_CW, tail):
        y, final = fla_causal_conv1d_op(x, weight_CW.to(x.dtype), _fla_window(tail, x.dtype))
        return y, final[:, :, 1:].transpose(1, 2)
    if fla_ok:
        variant = ("short_conv", x.dtype, tail is not None, packed, x.shape[0] > 1)
        fla_call = lambda: short_conv_fla(x, weight_CW, tail, cu_seqlens if packed else None)  # noqa: E731
        return with_torch_fallback(variant, fla_call, torch_call)
    return torch_call()


def _short_conv_torch_packed(x, weight_CW, tail, cu_seqlens, position_in_doc):
    """short_conv_torch with packed documents by position_in_doc or, failing that, by cu_seqlens."""
    positions = position_in_doc
    if positions is None and cu_seqlens is not None:
        starts = cu_seqlens[:-1].repeat_interleave(cu_seqlens.diff())
        positions = torch.arange(x.shape[1], device=x.device) - starts
    return short_conv_torch(x, weight_CW, tail, positions)


def short_conv_parts(x: torch.Tensor, weight_CW: torch.Tensor, parts: int, tail: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, position_in_doc: torch.Tensor | None = None,
                     planar: bool = False, conv=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """short_conv of `parts` column blocks side by side (KDA's joined q/k/v conv) -> ([y_p [B, T, C / parts]],
    the joined new tail [B, W-1, C] as short_conv returns it). Where the Triton path runs, the parts come
    contiguous from its planar launch (k3.ops.short_conv_triton.short_conv_triton_parts: no copies forward,
    none backward), which is what fla's chunk_kda takes without a copy of its own. Elsewhere they are column
    slices of short_conv's output, or, with `planar`, contiguous copies of them ([parts, B, T, C / parts] in one
    block) for kernels that take contiguous inputs. `conv`: the joined conv those paths call (short_conv when
    None; k3.layers.kda passes the name it imported, which tests wrap to count its calls)."""
    if _uses_triton(x, weight_CW, tail):
        ys = short_conv_triton_parts(x, weight_CW, parts, cu_seqlens=cu_seqlens, position_in_doc=position_in_doc)
        return list(ys), _tail_of(x, weight_CW.shape[-1])
    y, new_tail = (conv or short_conv)(x, weight_CW, tail, cu_seqlens=cu_seqlens, position_in_doc=position_in_doc)
    width = y.shape[-1] // parts
    ys = y.unflatten(-1, (parts, width)).movedim(-2, 0).contiguous().unbind(0) if planar else y.split(width, -1)
    return list(ys), new_tail
