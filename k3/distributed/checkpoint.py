"""Layout-independent checkpoints: the full (single-device) state dict, gathered on rank 0.

The file is exactly what a single-device K3ForCausalLM.state_dict() holds (expert stacks [E, ...] whole,
FSDP shards joined), so a checkpoint saved under any layout (1 process, EP=2, EP=4, FSDP only) loads under
any other, and into a plain single-device model with `load_state_dict`. Gathering on rank 0 needs the
whole model in rank 0's CPU memory: right for the sizes trained here (`small` and below), not for K3 itself.

File: torch.save({"model": state_dict, "config": ModelConfig.to_dict(), "format": FORMAT}), written
atomically (temporary file in the same folder, fsync, os.replace).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule

from k3.atomic import atomic_write
from k3.distributed.launch import barrier, is_distributed, is_main

FORMAT = "k3-full-state-dict-v1"


def _is_parallel(model: nn.Module) -> bool:
    layout = getattr(model, "parallel_layout", None)
    return layout is not None and layout.world_size > 1


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit back into its sharded form. After a forward without backward (evaluation) the root
    unit keeps its parameters gathered (FSDP does not reshard the root after forward), and a state dict
    loaded then would be copied into plain gathered tensors instead of being sharded."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The single-device state dict on CPU; complete on rank 0, empty on other ranks. Collective."""
    if not _is_parallel(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _atomic_save(payload: dict, path: Path) -> None:
    atomic_write(path, lambda handle: torch.save(payload, handle))


def save_checkpoint(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the model's full state dict (and config) to `path` from rank 0. Collective: call on every rank."""
    state = full_state_dict(model)
    if is_main():
        config = getattr(model, "config", None)
        _atomic_save({"format": FORMAT, "model": state, "config": config.to_dict() if config is not None else None},
                     Path(path))
    barrier()


def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> dict:
    """Load a checkpoint written by `save_checkpoint` under any layout into `model` (parallelized or not).
    Collective for a parallelized model. Returns the file's payload (config included)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; give the file written by save_checkpoint")
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (found format "
                         f"{payload.get('format') if isinstance(payload, dict) else type(payload).__name__!r})")
    load_full_state_dict(model, payload["model"])
    if is_distributed():
        barrier()
    return payload


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a single-device state dict (every rank holds the whole of it) into `model`, parallelized or not.
    Collective for a parallelized model: each rank keeps its own shards."""
    if _is_parallel(model):
        reshard(model)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    else:
        model.load_state_dict(state, strict=True)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state in the single-device `optimizer.state_dict()` form (parameters numbered in group
    order), gathered whole on rank 0 (empty on the others). Collective for a parallelized model."""
    if not _is_parallel(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not by_name:
        return {}
    # torch.distributed.checkpoint keys the state by parameter name; a plain optimizer numbers parameters in
    # the order its groups list them, and the names (hence that order) are the single-device model's.
    number = {}
    for group in by_name["param_groups"]:
        for name in group["params"]:
            number[name] = len(number)
    return {"state": {number[name]: value for name, value in by_name["state"].items()},
            "param_groups": [{**group, "params": [number[n] for n in group["params"]]}
                             for group in by_name["param_groups"]]}


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an optimizer state in the single-device `optimizer.state_dict()` form (as `full_optimizer_state_dict`
    writes it; every rank holds the whole of it) into the optimizer of a parallelized model: each rank keeps
    the state of its own shards. Collective for a parallelized model."""
    if not _is_parallel(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    # The inverse of full_optimizer_state_dict's numbering: parameter i of the groups, in order, is the i-th
    # name. FSDP2 and EP keep the single-device parameter names, so the names come from the model itself.
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(state["param_groups"]) != len(optimizer.param_groups) or \
            sum(len(g["params"]) for g in state["param_groups"]) != len(names):
        raise ValueError("the saved optimizer state has other parameter groups than this optimizer; was it saved "
                         "from another model config or optimizer setup?")
    by_name = {"state": {names[number]: value for number, value in state["state"].items()},
               "param_groups": [{**group, "params": [names[n] for n in group["params"]]}
                                for group in state["param_groups"]]}
    reshard(model)
    # Not strict: parameters that never had a gradient have no optimizer state.
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True, strict=False))
