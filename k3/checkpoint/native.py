"""Native checkpoints: one torch file per checkpoint, written atomically.

A training checkpoint (`DIR/checkpoint.pt`) is a dict:
    model       the model's state_dict (balancer biases are buffers in it: `...gate.e_score_correction_bias`)
    optimizer   the optimizer's state_dict
    config      ModelConfig.to_dict()
    train       the run's TrainConfig as a dict
    step        optimizer steps done
    data        the data position (see k3.data.packing.BatchStream.state_dict)
    rng         torch / numpy / python RNG states as plain lists and numbers (k3.train.trainer._rng_state)
    tokenizer   {file name: bytes} of the tokenizer files, so the checkpoint stands alone
    format      CHECKPOINT_FORMAT

Everything in it is a tensor or a plain value (dict, list, str, number, bytes), so it loads with
torch.load(weights_only=True): reading a checkpoint from elsewhere runs none of its code.

Atomicity: the file is written to a temp file in the same directory, fsynced, then renamed over the old one;
a save that dies half-way leaves the previous checkpoint in place and loadable.
"""

from __future__ import annotations

import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from k3.atomic import atomic_write, atomic_write_bytes  # noqa: F401 (atomic_write_bytes re-exported)
from k3.config import ModelConfig

CHECKPOINT_FORMAT = "k3-native-1"
CHECKPOINT_NAME = "checkpoint.pt"


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint holds objects that only a full unpickle (which could run its code) would rebuild."""


def directory_files(directory: str | os.PathLike) -> dict[str, bytes]:
    """{file name: bytes} of the files directly in `directory` (a tokenizer's, say), in name order."""
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Atomically write a checkpoint dict (see the module docstring) with torch.save."""
    state = dict(state, format=CHECKPOINT_FORMAT)
    try:
        atomic_write(Path(path), lambda handle: torch.save(state, handle))
    except RuntimeError as error:  # torch's writer reports a full disk as "[enforce fail at inline_container...]"
        free = shutil.disk_usage(Path(path).parent).free
        raise RuntimeError(f"writing the checkpoint {path} failed ({str(error).splitlines()[0][:200]}); its disk "
                           f"has {free / 2**20:,.0f} MiB free: a full disk is the usual cause. Free space or "
                           f"choose another directory; the previous checkpoint is unchanged") from error


def load_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint dict; a directory means its checkpoint.pt. Raises a clear error when the file is
    missing, truncated, corrupt or not a k3 checkpoint. mmap: map the tensors from the file instead of reading
    them, so taking the small entries (config, tokenizer) reads none of the weights."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; give a run directory written by `k3 train` "
                                f"(it holds {CHECKPOINT_NAME}) or the checkpoint file itself")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if "Unsupported global" not in str(error):
            raise RuntimeError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {error}); "
                               f"restore it from a copy or train again") from error
        unsafe = str(error).split("WeightsUnpickler error:")[-1].strip().split(" was not")[0]
        raise UnsafeCheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain values ({unsafe}); k3 does not load "
            f"it, since unpickling them could run code. A checkpoint of an older k3 (RNG states as numpy "
            f"objects) can be rewritten by its owner, who trusts it, with torch.load(weights_only=False), "
            f"converting state['rng'] with k3.runtime.plain_rng_state, and torch.save") from error
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as error:
        raise RuntimeError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {error}); "
                           f"restore it from a copy or train again") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise RuntimeError(f"{path} is not a k3 native checkpoint (expected format {CHECKPOINT_FORMAT!r})")
    return state


def check_finite(state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights holding NaN or infinity (a model built from them generates garbage without a word)."""
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{source}: tensor {name} holds {bad} NaN or infinite values of {tensor.numel()}; the "
                             f"checkpoint is damaged (or was saved after training diverged): use an earlier one")


def load_model_state(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str,
                     assign: bool = False) -> None:
    """load_state_dict with an error that says which names or shapes disagree, or which tensor is not finite.
    assign: the checkpoint's tensors become the model's (a meta-device model is materialised from them)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    shapes = [f"{n}: checkpoint {tuple(state_dict[n].shape)} vs model {tuple(own[n].shape)}"
              for n in sorted(set(own) & set(state_dict)) if tuple(own[n].shape) != tuple(state_dict[n].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[:3]})")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatches (e.g. {shapes[:2]})")
        raise ValueError(f"checkpoint {source} does not match the model config: " + "; ".join(parts)
                         + ". Load it with the config saved in the checkpoint, or train a new run.")
    check_finite(state_dict, source)
    model.load_state_dict(state_dict, assign=assign)


def model_from_checkpoint(state: dict[str, Any], source: str = "checkpoint"):
    """Rebuild K3ForCausalLM from a checkpoint dict (its saved config), in eval mode. Built on the meta device
    and compared with the checkpoint's names and shapes before any weight is allocated: the config is the
    checkpoint author's, and one claiming a vocabulary of 10^9 made a 256 GB allocation before the comparison."""
    from k3.model import K3ForCausalLM

    config = ModelConfig.from_dict(state["config"])
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    own = model.state_dict()
    # Each tensor in the dtype the model would have built it in (as copying into a built model did).
    weights = {name: t.to(own[name].dtype) if name in own and t.is_floating_point() else t
               for name, t in state["model"].items()}
    load_model_state(model, weights, source, assign=True)
    if config.tie_word_embeddings:  # assigning both names would untie them
        model.lm_head.weight = model.model.embed_tokens.weight
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"after loading {source}, {still_meta[:5]} are still unmaterialised (meta tensors)")
    return model.eval()


def tokenizer_from_checkpoint(state: dict[str, Any], directory: str | os.PathLike):
    """Write the tokenizer files stored in a checkpoint into `directory` and load them."""
    from k3.data.tokenizer import load_tokenizer

    files = state.get("tokenizer") or {}
    if not files:
        raise RuntimeError("the checkpoint holds no tokenizer files")
    directory = Path(directory)
    for name, data in files.items():
        # names come from the checkpoint's author: a path ("../x", "/etc/x", "a/b") would write outside directory
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ValueError(f"the checkpoint's tokenizer entry {name!r} is not a plain file name; a k3 checkpoint "
                             f"stores its tokenizer files by name only (e.g. 'tokenizer.json')")
        if not isinstance(data, bytes):
            raise ValueError(f"the checkpoint's tokenizer entry {name!r} holds {type(data).__name__}, not bytes")
    for name, data in files.items():
        atomic_write_bytes(directory / name, data)
    return load_tokenizer(directory)
