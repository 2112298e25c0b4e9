"""Build a parallelized model without ever holding the whole of it: meta device -> parallelize -> storage for
this rank's shards only -> a seeded initialisation of those shards.

`K3ForCausalLM(config).to(device)` materialises every weight on every rank before `parallelize` shards it:
fine for `small`, impossible for a model that outgrows one GPU. `build_parallel_model` builds the model on the
meta device, shards it (FSDP2 + EP), allocates only the local shards (`to_empty`), then fills them with
`init_weights_seeded`.

`init_weights_seeded(model, seed)` is layout-independent: every tensor is a function of (seed, its name) only,
so one process and any FSDP / EP layout give the same full model (a test compares them).
    - expert stacks [E, ...]: expert e is drawn from its own generator, seeded by (seed, name, e); a rank draws
      only its local experts;
    - every other module: its own tensors are made at full size on this rank, initialised by the module's
      own rule (`k3.model.init_module`) under a seed derived from the module's name, and each rank keeps its
      slice. The largest such tensor is the embedding / LM head (vocab x hidden), never an expert stack.
It draws from other streams than `K3ForCausalLM.init_weights` (the global RNG), so the two give different,
equally distributed weights.

Shape suffixes: E experts.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from k3.config import ModelConfig
from k3.layers.moe import LatentMoE
from k3.model import K3ForCausalLM, init_module, zero_attn_res_queries


def _seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a name (stable across processes, unlike hash())."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32("/".join(map(str, parts)).encode())) % (2**63)


def _local_slices(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the tensor this rank writes, the part of the full tensor it holds) for a DTensor or a plain tensor."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def _init_experts(name: str, moe: LatentMoE, seed: int, std: float) -> None:
    for weight_name in ("w1", "w3", "w2"):
        local, slices = _local_slices(getattr(moe, weight_name))
        first_expert = slices[0].start
        for i in range(local.shape[0]):
            generator = torch.Generator(device=local.device).manual_seed(_seed(seed, name, weight_name,
                                                                               first_expert + i))
            local[i].normal_(0.0, std, generator=generator)


@torch.no_grad()
def _init_module_at_full_size(name: str, module: nn.Module, seed: int, std: float) -> None:
    """Run the module's own init on full-size stand-ins for its tensors, then keep this rank's slices."""
    own = {key: value for key, value in list(module._parameters.items()) + list(module._buffers.items())
           if value is not None}
    originals = {}
    for key, value in own.items():
        local, _ = _local_slices(value)
        full = torch.empty(tuple(value.shape), dtype=local.dtype, device=local.device)
        originals[key] = value
        if key in module._parameters:
            module._parameters[key] = nn.Parameter(full, requires_grad=False)
        else:
            module._buffers[key] = full
    devices = [originals[next(iter(originals))].device] if any(v.is_cuda for v in originals.values()) else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_seed(seed, name))
            init_module(module, std)
        written = {key: (module._parameters.get(key) if key in module._parameters else module._buffers[key])
                   for key in originals}
    finally:
        for key, value in originals.items():
            if key in module._parameters:
                module._parameters[key] = value
            else:
                module._buffers[key] = value
    for key, value in originals.items():
        local, slices = _local_slices(value)
        local.copy_(written[key][slices])


@torch.no_grad()
def init_weights_seeded(model: K3ForCausalLM, seed: int = 0) -> None:
    """Initialise every parameter and buffer of `model` (plain or parallelized, after `to_empty`) so that the
    full model depends on `seed` alone, not on the layout. Every rank calls it; no communication."""
    std = model.config.initializer_range
    done: set[int] = set()  # tied weights: initialise once
    for name, module in model.named_modules():
        own = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
        if not own or all(id(t) in done for t in own):
            continue
        done.update(id(t) for t in own)
        if isinstance(module, LatentMoE):
            _init_experts(name, module, seed, std)
        else:
            _init_module_at_full_size(name, module, seed, std)
    zero_attn_res_queries(model)


def build_parallel_model(config: ModelConfig, device: torch.device | str, ep_size: int = 1,
                         balanced: bool = False, seed: int = 0, qb_aggregate: str = "gather") -> K3ForCausalLM:
    """A K3ForCausalLM sharded over all ranks (FSDP2 + EP, as `parallelize`), whose full weights never exist on
    any one rank. Collective: call on every rank with the same arguments."""
    from k3.distributed.parallelize import parallelize

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = parallelize(model, ep_size=ep_size, balanced=balanced, qb_aggregate=qb_aggregate)
    model.to_empty(device=device)
    init_weights_seeded(model, seed)
    return model
