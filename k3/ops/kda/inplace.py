"""Decode-time KDA that advances recurrent states where they live: a pool of slots, rows picked by index.

An out-of-place decode step gathers the rows' states from the pool, lets the kernel read them and write new
ones, and scatters those back: six times the state bytes. Here the kernel reads each row's state from its slot
and writes the new state into the same slot: twice. fla's lower-level `fused_recurrent_kda_fwd` does this in its
continuous-batching mode (ssm_state_indices, inplace_final_state; fla's public entry point never asks for it);
the PyTorch twin gathers, runs the recurrence and scatters, with the same result.

Shape legend: B batch (rows), T new tokens per row, H heads, K key dim, V value dim, S slots in the pool.
fla's kernel, read in fla 0.6.0 (fla/ops/kda/fused_recurrent.py), and what the callers here rely on:
- each row's slot index is loaded and widened to int64 in the kernel: int32 and int64 indices both work;
- indices are not bounds-checked: a negative or >= S index reads and writes outside the pool (no padding id
  is skipped). Padded rows must point at a real scratch slot. The PyTorch twin raises instead;
- with continuous batching the state is stored after *every* token, at indices[row * stride + t]: with [B]
  indices and T > 1 token t would land in the slot of row + t, so T > 1 takes [B, T] indices, contiguous
  along T (the kernel ignores the token stride), every column the row's slot;
- the pool's per-slot layout must be contiguous [H, K, V] (any slot stride), in fp32 for an fp32 state;
- the launcher does no input_guard: q, k, v, g, beta must be contiguous and the launch device current;
- two rows with the same slot race (the pool's scratch slot, shared by padded rows, holds garbage anyway);
- the pool's slot stride and the indices' row stride are Triton constexprs: each new value (a pool of another
  layout, another T) compiles the kernel once more.
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch

from k3.ops.kda.recurrent import fused_recurrent_kda_torch


def check_state_pool(q: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor,
                     state_indices: torch.Tensor) -> None:
    """Raise a ValueError naming what breaks the in-place layout; metadata only (no device sync)."""
    B, _, H, K = q.shape
    V = v.shape[-1]
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool must be [S, H, K, V] = [S, {H}, {K}, {V}], got {tuple(state_pool.shape)}")
    if state_pool.dtype != torch.float32:
        raise ValueError(f"state_pool must be fp32 (the recurrent state is carried in fp32), got {state_pool.dtype}")
    if state_pool.shape[0] > 0 and not state_pool[0].is_contiguous():
        raise ValueError("each slot of state_pool must be a contiguous [H, K, V] block (fla addresses it so); got "
                         f"strides {state_pool.stride()}")
    if state_indices.dim() != 1 or state_indices.shape[0] != B:
        raise ValueError(f"state_indices must be [B] = [{B}] (one slot per row), got {tuple(state_indices.shape)}")
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be int32 or int64, got {state_indices.dtype}")
    if state_pool.device != q.device or state_indices.device != q.device:
        raise ValueError(f"q, state_pool and state_indices must share a device, got {q.device}, "
                         f"{state_pool.device}, {state_indices.device}")


def fused_recurrent_kda_inplace_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> torch.Tensor:
    """The PyTorch twin: gather the rows' slots, run the recurrence, scatter the final states back.
    index_select raises on an index outside [0, S), where fla's kernel would write out of bounds."""
    state_indices = state_indices.long()  # index_copy_ takes int64 only
    initial = state_pool.index_select(0, state_indices)
    o, final = fused_recurrent_kda_torch(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial,
                                         output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                         **kwargs)
    state_pool.index_copy_(0, state_indices, final)
    return o


def find_fla_inplace_fwd(fla_kda: types.ModuleType) -> object | str:
    """fla's lower-level `fused_recurrent_kda_fwd` when it offers the in-place continuous-batching mode, else
    why not as text. It is not one of fla's public entry points, so an fla without it (or with another
    signature) leaves k3 on the gather / out-of-place / scatter path instead of failing. Looked up on the
    `fla.ops.kda` module that gave the entry points (its `fused_recurrent` submodule), not imported by name:
    whatever stands in for that module (tests' CPU stand-ins) then stands in for this function too."""
    fwd = getattr(getattr(fla_kda, "fused_recurrent", None), "fused_recurrent_kda_fwd", None)
    if fwd is None:
        return f"{fla_kda.__name__} has no fused_recurrent.fused_recurrent_kda_fwd"
    try:
        parameters = inspect.signature(fwd).parameters
    except (TypeError, ValueError) as exc:
        return f"cannot read the signature of fla's fused_recurrent_kda_fwd: {exc}"
    missing = {"inplace_final_state", "ssm_state_indices", "use_gate_in_kernel", "lower_bound"} - set(parameters)
    if missing:
        return f"fla's fused_recurrent_kda_fwd lacks {sorted(missing)}"
    return fwd


def fused_recurrent_kda_inplace_fla(fwd, q, k, v, g, beta, state_pool, state_indices, scale,
                                    use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                    use_beta_sigmoid_in_kernel, lower_bound) -> torch.Tensor:
    """fla's `fused_recurrent_kda_fwd` (find_fla_inplace_fwd) with ssm_state_indices and
    inplace_final_state=True; returns o [B, T, H, V] in v's dtype."""
    length = q.shape[1]
    # Stored after every token at indices[row, t] (see the module doc): one column per token, all the row's slot.
    indices = state_indices if length == 1 else state_indices[:, None].expand(-1, length).contiguous()
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    A_log, dt_bias = (None if t is None else t.contiguous() for t in (A_log, dt_bias))  # flat-indexed per head
    # Triton launches on the current device; fla's public entry points set it (input_guard), this one does not.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        o, _ = fwd(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=state_pool,
                   scale=scale, output_final_state=False, inplace_final_state=True, ssm_state_indices=indices,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound)
    return o
