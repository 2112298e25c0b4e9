"""Sharded checkpoints through torch.distributed.checkpoint (DCP), for models too big to gather on one rank.

`save_checkpoint` (checkpoint.py) gathers the whole model on rank 0: simple, one file, but rank 0 must hold
the full model in CPU memory. Here every rank writes only the shards it owns, all ranks at once, and nothing
is gathered. The checkpoint is a directory of DCP files. DCP reshards on load, so a checkpoint saved under one
layout (1 process, FSDP only, EP=2, EP=4, ...) loads under any other, and into a single process without a
process group. Model and optimizer state are keyed by the single-device parameter names, which every layout
shares, plus a small `extra` dict of JSON values (step counters, config) the caller wants back.

Atomic: DCP writes into a temporary sibling directory; after every rank has finished (a barrier), rank 0
swaps it into place with renames, so a crash mid-save leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from k3.distributed.checkpoint import _reshard
from k3.distributed.launch import barrier, is_distributed, is_main

FORMAT = "k3-sharded-dcp-v1"
METADATA_NAME = ".metadata"  # DCP's own index file: present in every finished checkpoint directory


@contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load ("assuming the intent is ..."); here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    options = StateDictOptions(full_state_dict=False)  # shards as they are: DTensors stay DTensors
    if optimizer is None:
        model_state, _ = get_state_dict(model, optimizers=[], options=options)
        return {"model": model_state}
    model_state, optimizer_state = get_state_dict(model, optimizers=optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def _broadcast_path(path: Path) -> Path:
    """Rank 0's choice of a path, on every rank (temporary names must agree)."""
    if not is_distributed():
        return path
    holder = [str(path)]
    torch.distributed.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: dict | None = None) -> None:
    """Write model (and optimizer) shards from every rank into the directory `path`. Collective."""
    path = Path(path)
    staging = _broadcast_path(path.with_name(f".{path.name}.tmp-{os.getpid()}"))
    if is_main():
        shutil.rmtree(staging, ignore_errors=True)
    barrier()
    state = _state(model, optimizer)
    state["k3"] = {"format": FORMAT, "extra_json": json.dumps(extra or {})}
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(staging), no_dist=not is_distributed())
    barrier()
    if is_main():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / METADATA_NAME).is_file()


def read_sharded_extra(path: str | os.PathLike) -> dict:
    """The `extra` dict of a finished sharded checkpoint, without loading any tensor. Runs in any process, with
    or without a process group (it reads only the small metadata entries)."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a finished sharded checkpoint (no {METADATA_NAME}); give the "
                                "directory written by save_sharded")
    state = {"k3": {"format": None, "extra_json": None}}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    if state["k3"]["format"] != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (found format {state['k3']['format']!r})")
    return json.loads(state["k3"]["extra_json"])


def load_sharded(path: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a directory written by `save_sharded` (under any layout) into `model` (and `optimizer`), in this
    process's layout. Collective for a parallelized model. Returns the saved `extra` dict."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"sharded checkpoint {path} does not exist; give the directory written by "
                                "save_sharded")
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} has no {METADATA_NAME}: not a finished sharded checkpoint (an interrupted save "
                         "leaves only a hidden .tmp directory beside it)")
    state = _state(model, optimizer)
    state["k3"] = {"format": None, "extra_json": None}  # placeholders DCP overwrites with the saved values
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [name for name in state["model"] if f"model.{name}" not in saved]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of this model's tensors (first: {missing[:3]}); was it "
                         "saved from a model of another config?")
    # Partial load for the optimizer only: torch fills a fresh optimizer with zero state for every parameter,
    # while the saved one has none for parameters that never had a gradient (equivalent for AdamW).
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=not is_distributed())
    if state["k3"]["format"] != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (found format {state['k3']['format']!r})")
    _reshard(model)  # as load_checkpoint does: after an eval forward FSDP's root keeps parameters gathered
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    if optimizer is not None:
        # Not strict: parameters that never had a gradient have no optimizer state, saved or loaded.
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    return json.loads(state["k3"]["extra_json"])
