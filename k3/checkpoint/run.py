"""Which checkpoint a `k3 train` run directory holds, and loading its model for inference or conversion.

A run keeps one of two kinds (TrainConfig.checkpoint_format):
    DIR/checkpoint.pt   "full": one torch file, gathered on rank 0 (k3.checkpoint.native)
    DIR/checkpoint/     "sharded": a torch.distributed.checkpoint directory, every rank writing its own shards
                        (k3.distributed.sharded_checkpoint); for models too large to gather on one rank

Both load into a single process, or under any parallel layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from k3.checkpoint.native import CHECKPOINT_NAME, directory_files

SHARDED_CHECKPOINT_NAME = "checkpoint"
FORMATS = ("full", "sharded")


def checkpoint_path(run_dir: str | os.PathLike, fmt: str) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format must be one of {FORMATS}, got {fmt!r}")
    return Path(run_dir) / (CHECKPOINT_NAME if fmt == "full" else SHARDED_CHECKPOINT_NAME)


def saved_format(run_dir: str | os.PathLike) -> str | None:
    """"full" or "sharded" for the finished checkpoint in run_dir, or None when it holds none. A trainer keeps
    one kind at a time (saving one removes the other); a crash between the two leaves both, and the newer one
    is the run's."""
    from k3.distributed.sharded_checkpoint import METADATA_NAME, is_sharded_checkpoint

    run_dir = Path(run_dir)
    full = run_dir / CHECKPOINT_NAME
    sharded = run_dir / SHARDED_CHECKPOINT_NAME
    if full.is_file() and is_sharded_checkpoint(sharded):
        return "full" if full.stat().st_mtime >= (sharded / METADATA_NAME).stat().st_mtime else "sharded"
    if full.is_file():
        return "full"
    if is_sharded_checkpoint(sharded):
        return "sharded"
    return None


def _sharded_to_load(run: Path) -> Path | None:
    """The sharded checkpoint directory to load for `run` (a run directory or the sharded directory itself), or
    None when the run's checkpoint is the full one (a checkpoint.pt)."""
    sharded = run if run.name == SHARDED_CHECKPOINT_NAME and run.is_dir() else run / SHARDED_CHECKPOINT_NAME
    if run.is_dir() and saved_format(run) != "full" and sharded.is_dir():
        return sharded
    return None


def _sharded_metadata(sharded: Path) -> dict[str, Any]:
    from k3.distributed.sharded_checkpoint import read_sharded_extra

    meta = read_sharded_extra(sharded)
    if "config" not in meta:
        raise ValueError(f"{sharded} holds no model config: it was not written by `k3 train`")
    # The shards hold no tokenizer; the run directory beside them does.
    tokenizer_dir = sharded.parent / "tokenizer"
    if "tokenizer" not in meta and tokenizer_dir.is_dir():
        meta["tokenizer"] = directory_files(tokenizer_dir)
    return meta


def read_run_metadata(run: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint dict of a run directory, its checkpoint.pt or its sharded checkpoint directory without
    model/optimizer, reading none of the weights: the config, step and, when saved, `tokenizer`."""
    from k3.checkpoint.native import load_checkpoint

    run = Path(run)
    sharded = _sharded_to_load(run)
    if sharded is not None:
        return _sharded_metadata(sharded)
    state = load_checkpoint(run, mmap=True)  # the weights stay mapped, unread
    return {k: v for k, v in state.items() if k not in ("model", "optimizer")}


def load_run_model(run: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """(model in eval mode, checkpoint dict without model/optimizer) from a run directory, its checkpoint.pt,
    or its sharded checkpoint directory. The dict holds at least `config`, `step` and, when saved, `tokenizer`
    ({file name: bytes})."""
    from k3.checkpoint.native import load_checkpoint, model_from_checkpoint

    run = Path(run)
    sharded = _sharded_to_load(run)
    if sharded is not None:
        from k3.config import ModelConfig
        from k3.distributed.sharded_checkpoint import load_sharded
        from k3.model import K3ForCausalLM

        meta = _sharded_metadata(sharded)
        model = K3ForCausalLM(ModelConfig.from_dict(meta["config"]))
        load_sharded(sharded, model)
        return model.eval(), meta
    state = load_checkpoint(run)
    model = model_from_checkpoint(state, str(run))
    return model, {k: v for k, v in state.items() if k not in ("model", "optimizer")}


def vision_from_checkpoint(state: dict[str, Any], source: str = "checkpoint"):
    """(VisionModel in eval mode, media token id) of a checkpoint that keeps a vision tower (a run trained on
    image-text data: keys vision, vision_config, media_token_id), else None."""
    from k3.checkpoint.native import load_model_state
    from k3.vision.config import VisionConfig
    from k3.vision.model import VisionModel

    if "vision" not in state:
        return None
    vision = VisionModel(VisionConfig.from_dict(state["vision_config"]))
    load_model_state(vision, state["vision"], source)
    return vision.eval(), int(state["media_token_id"])


def load_run_multimodal(run: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """(K3ForConditionalGeneration in eval mode, checkpoint dict without weights) of a run trained on image-text
    data; ValueError for a run without a vision tower."""
    import torch

    from k3.multimodal import K3ForConditionalGeneration

    model, state = load_run_model(run)
    found = vision_from_checkpoint(state, str(run))
    if found is None:
        raise ValueError(f"{run} holds no vision tower: it was not trained on image-text data (docs/vision.md)")
    vision, media = found
    with torch.device("meta"):
        multimodal = K3ForConditionalGeneration(model.config, vision.config, media)
    multimodal.language_model, multimodal.vision = model, vision
    return multimodal.eval(), {k: v for k, v in state.items() if k != "vision"}
