"""Projections that read the same input, run as one GEMM over weights that live in one buffer.

A decode step multiplies one token per sequence by every weight: at small batch each GEMM is a few
microseconds of launch and tail, not bytes (measured for `small` on one H200: 148 projection GEMMs of ~6 us
each in a 3.2 ms step). `fuse_model_weights` moves the weights of each such group into one contiguous buffer
and rebinds every weight as a view of its slice, so the names, shapes, state_dict and checkpoint layout stay as
they were, and an in-place update of any weight (an optimizer step, `copy_` from the policy in RL) is an update
of the buffer: a CUDA graph or a compiled step that reads the buffer sees it, under the same contract CUDA
graphs already have (k3.infer.engine.Engine.weights_changed).

Groups (each layer lists its own in `fusable_groups()`; its forward asks `fused(self, name)` and falls back to its separate projections when
the group is absent or its views no longer point into the buffer, e.g. after `model.to(...)` replaced them):
- KDA: q, k, v, f_a, the output gate's first projection, beta: six projections of x as one GEMM (q, k and v
  come out side by side for the joined short conv); and the q, k, v short-conv weights as one [3C, 1, W] buffer,
  so the joined conv does not concatenate them at every step;
- MLA: q_a (or q), kv_a_proj_with_mqa and the output gate g_proj;
- GLU MLPs (dense layers): gate and up;
- latent MoE layers with shared experts: the latent down projection with the shared expert's gate and up (all
  read x), and the latent up projection with the shared expert's down projection, side by side along their
  inputs ([D, L + F]: one GEMM sums both into the layer's output);
- latent MoE experts: w1 and w3 as one [E, 2F, L] buffer, one grouped GEMM instead of two (w1 and w3 become
  strided views of it).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.linear_triton import linear

FUSED_ATTR = "_k3_fused"


class FusedGroup:
    """One buffer and the (module, parameter name, slice along `dim`) of each weight viewed into it."""

    def __init__(self, members: list[tuple[nn.Module, str]], dim: int) -> None:
        weights = [getattr(module, name) for module, name in members]
        first = weights[0]
        for w in weights[1:]:
            if w.dtype != first.dtype or w.device != first.device or w.dim() != first.dim() or any(
                    a != b for i, (a, b) in enumerate(zip(w.shape, first.shape)) if i != dim):
                raise ValueError(f"cannot fuse weights of shapes {[tuple(v.shape) for v in weights]} along dim {dim}")
        with torch.no_grad():
            self.buffer = torch.cat([w.detach() for w in weights], dim=dim).contiguous()
        self.sizes = [w.shape[dim] for w in weights]
        self.members = members
        start = 0
        for (module, name), w, size in zip(members, weights, self.sizes):
            view = self.buffer.narrow(dim, start, size)
            setattr(module, name, nn.Parameter(view, requires_grad=w.requires_grad))
            start += size
        self._pointers = self._expected_pointers()

    def _expected_pointers(self) -> list[tuple[int, tuple[int, ...]]]:
        return [(getattr(m, n).data_ptr(), tuple(getattr(m, n).shape)) for m, n in self.members]

    def intact(self) -> bool:
        """Every weight still a view of the buffer (not replaced by `.to(...)` or a new Parameter)."""
        dtype_ok = all(getattr(m, n).dtype == self.buffer.dtype for m, n in self.members)
        return dtype_ok and self._expected_pointers() == self._pointers

    def usable(self) -> bool:
        """The buffer may stand for the weights: no gradient is wanted for them (the buffer carries none back to
        the parameters) and the group is intact (compiled code cannot ask: it trusts the group)."""
        if torch.is_grad_enabled() and any(getattr(m, n).requires_grad for m, n in self.members):
            return False
        return torch.compiler.is_compiling() or self.intact()


def _group(owner: nn.Module, name: str) -> FusedGroup | None:
    return owner.__dict__.get(FUSED_ATTR, {}).get(name)


def fuse(owner: nn.Module, group: str, members: list[tuple[nn.Module, str]], dim: int = 0) -> FusedGroup:
    """Fuse `members` (module, parameter name) of `owner` along `dim` under the name `group`."""
    groups = owner.__dict__.setdefault(FUSED_ATTR, {})
    groups[group] = FusedGroup(members, dim)
    return groups[group]


def fused(owner: nn.Module, group: str) -> FusedGroup | None:
    """The fused group `group` of `owner` when usable, else None (never fused, its views were replaced, or a
    gradient is wanted for its weights: training keeps the separate projections)."""
    found = _group(owner, group)
    return found if found is not None and found.usable() else None


def fusable(members: list[tuple[nn.Module, str]]) -> bool:
    """Plain tensors only: a sharded (DTensor) weight has no local buffer to view into."""
    from torch.distributed.tensor import DTensor

    return not any(isinstance(getattr(m, n), DTensor) for m, n in members)


def linear_group(x: torch.Tensor, group: FusedGroup, join_first: int = 1) -> list[torch.Tensor]:
    """x @ each fused [out_i, in] weight, as one GEMM: the outputs in the group's order, the first `join_first`
    of them as one tensor (adjacent in the GEMM's output, so joining them costs nothing)."""
    sizes = [sum(group.sizes[:join_first]), *group.sizes[join_first:]]
    return list(linear(x, group.buffer.to(x.dtype)).split(sizes, dim=-1))


KINDS = ("kda", "kda_conv", "mla", "mlp", "experts", "moe_input", "moe_output")
# What a layer's fusable_groups() lists: (kind, group name, members as (module, attribute), the dim they join on).
Group = tuple[str, str, list[tuple[nn.Module, str]], int]


def fuse_model_weights(model: nn.Module) -> dict[str, int]:
    """Fuse in place every group the model's layers list in `fusable_groups()` (the module doc); returns how many
    groups of each kind. A group with a weight an earlier group holds is skipped (a latent MoE's groups hold its
    shared expert's, which comes after it in model.modules()). Idempotent."""
    counts = dict.fromkeys(KINDS, 0)
    taken: set[tuple[int, str]] = set()
    for module in model.modules():
        list_groups = getattr(module, "fusable_groups", None)
        for kind, name, members, dim in list_groups() if callable(list_groups) else ():
            if not fusable(members) or any((id(m), n) in taken for m, n in members):
                continue
            existing = _group(module, name)
            if existing is None or not existing.intact():
                fuse(module, name, members, dim=dim)
            taken.update((id(m), n) for m, n in members)
            counts[kind] += 1
    return counts


def unfuse_model_weights(model: nn.Module) -> int:
    """Undo fuse_model_weights: every weight gets its own storage again (values kept); returns groups undone."""
    undone = 0
    for module in model.modules():
        groups = module.__dict__.pop(FUSED_ATTR, {})
        for group in groups.values():
            for member, name in group.members:
                weight = getattr(member, name)
                setattr(member, name, nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad))
            undone += 1
    return undone
