"""Sharded checkpoints through torch.distributed.checkpoint (DCP), for models too big to gather on one rank.

`save_checkpoint` (checkpoint.py) gathers the whole model on rank 0: simple, one file, but rank 0 must hold
the full model in CPU memory. Here every rank writes only the shards it owns, all ranks at once, and nothing
is gathered. The checkpoint is a directory of DCP files. DCP reshards on load, so a checkpoint saved under one
layout (1 process, FSDP only, EP=2, EP=4, ...) loads under any other, and into a single process without a
process group. Model and optimizer state are keyed by the single-device parameter names, which every layout
shares, plus a small `extra` dict of JSON values (step counters, config) the caller wants back.

Atomic: DCP writes into a temporary sibling directory; after every rank has finished (a barrier), rank 0
swaps it into place with renames, so a crash mid-save leaves the previous checkpoint whole.

Loading runs no code from the files: DCP's own reader unpickles `.metadata` and its non-tensor entries with
plain pickle; here the index goes through an unpickler that builds only DCP's metadata classes, and the
entries through torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from k3.distributed.checkpoint import reshard
from k3.checkpoint.native import UnsafeCheckpointError
from k3.distributed.launch import barrier, is_distributed, is_main

FORMAT = "k3-sharded-dcp-v1"
METADATA_NAME = ".metadata"  # DCP's own index file: present in every finished checkpoint directory


@contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load ("assuming the intent is ..."); here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield


# What a DCP `.metadata` index may name: DCP's metadata records, torch.Size, dtypes, layouts and paths; building
# any of them runs no code of the file's choosing.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"the sharded checkpoint's {METADATA_NAME} names {module}.{name}, which is not "
                                    "part of a torch.distributed.checkpoint index; it is not loaded, since "
                                    "unpickling it could run code")


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose index is read by _MetadataUnpickler instead of pickle.load."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            data = handle.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as error:
            raise ValueError(f"{path} is not a readable torch.distributed.checkpoint index "
                             f"({type(error).__name__}: {error})") from error
        if not isinstance(metadata, dcp.metadata.Metadata):
            raise ValueError(f"{path} holds a {type(metadata).__name__}, not a torch.distributed.checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn} of a sharded checkpoint holds objects "
                                        f"other than tensors and plain values; not loaded ({error})") from error
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _load(state: dict, path: Path, no_dist: bool) -> None:
    _SafeReader(str(path)).read_metadata()  # a refused index fails here with its own message, not DCP's wrapper
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafePlanner(allow_partial_load=True),
                     no_dist=no_dist)
    except CheckpointException as error:
        for failure, _ in error.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise failure from None
        raise


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
    _load(state, path, no_dist=True)
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
    saved = _SafeReader(str(path)).read_metadata().state_dict_metadata
    missing = [name for name in state["model"] if f"model.{name}" not in saved]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of this model's tensors (first: {missing[:3]}); was it "
                         "saved from a model of another config?")
    # Partial load for the optimizer only: torch fills a fresh optimizer with zero state for every parameter,
    # while the saved one has none for parameters that never had a gradient (equivalent for AdamW).
    _load(state, path, no_dist=not is_distributed())
    if state["k3"]["format"] != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (found format {state['k3']['format']!r})")
    reshard(model)  # as load_checkpoint does: after an eval forward FSDP's root keeps parameters gathered
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    if optimizer is not None:
        # Not strict: parameters that never had a gradient have no optimizer state, saved or loaded.
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    return json.loads(state["k3"]["extra_json"])
