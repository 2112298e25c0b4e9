"""TrainConfig's sections: the flags that build them, and runs saved in the earlier flat layout."""

from __future__ import annotations

import json

import pytest

from k3.cli import build_parser
from k3.checkpoint.native import load_checkpoint, save_checkpoint
from k3.cli_config import given, to_flat
from k3.train.config import DataConfig, RecallConfig, TrainConfig
from k3.train.trainer import Trainer

# TrainConfig().to_dict() when every field sat at the top: the layout of runs written before the sections.
FLAT_DEFAULTS = {
    "preset": "tiny", "out": "runs/tiny", "max_steps": 200, "seq_len": 256, "batch_size": 8, "lr": 0.003,
    "min_lr_ratio": 0.1, "warmup_steps": 20, "weight_decay": 0.1, "grad_clip": 1.0, "dtype": "auto", "device": "auto",
    "seed": 0, "data": [], "max_corpus_mb": None, "tokenizer": None, "tokenizer_sample_mb": 20.0,
    "val_fraction": 0.05, "eval_every": 50, "eval_batches": 4, "save_every": 50, "recall_fraction": 0.0,
    "recall_pairs": 8, "recall_queries": 0, "recall_length": 0, "recall_weight": 1.0, "time_budget_s": None, "ep": 0,
    "checkpoint_format": "full", "ep_balanced": False, "qb_aggregate": "gather", "seq_len_schedule": None,
    "qb_iters": 0, "global_batch": False, "moe_aux_loss": 0.0, "model_overrides": {}, "cuda_graph": None,
    "max_documents_per_row": 0, "log_every": 0, "master_weights": "auto", "vision": None, "vision_train": "all",
    "vision_lr": None, "image_fraction": 0.5, "max_image_patches": None, "max_image_pixels": None,
    "max_image_bytes": 33554432, "skip_bad_images": False, "allow_image_paths_outside": False}


def test_every_earlier_field_keeps_its_name_and_default() -> None:
    assert to_flat(TrainConfig()) == FLAT_DEFAULTS


def test_the_flat_layout_reads_back() -> None:
    old = {**FLAT_DEFAULTS, "lr": 1e-3, "recall_fraction": 0.5, "save_every": 7, "checkpoint_format": "sharded"}
    config = TrainConfig.from_dict(old)
    assert (config.optim.lr, config.recall.fraction, config.checkpoint.every, config.checkpoint.format) == (
        1e-3, 0.5, 7, "sharded")
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_flags_build_the_sections() -> None:
    args = build_parser().parse_args(["train", "--out", "r", "--lr", "1e-3", "--seq-len-schedule", "16:0,32:4",
                                      "--recall-fraction", "0.5", "--recall-pairs", "3", "--save-every", "9",
                                      "--checkpoint-format", "sharded", "--eval-every", "5", "--eager",
                                      "--data", "a.txt", "--data", "b", "--vision-train", "none"])
    config = TrainConfig.flat(**given(TrainConfig, args))
    assert config.optim.lr == 1e-3 and config.cuda_graph is False and config.images.vision_train == "none"
    assert config.data == DataConfig(data=["a.txt", "b"], seq_len=16, seq_len_schedule=[[16, 0], [32, 4]])
    assert config.recall == RecallConfig(fraction=0.5, pairs=3)
    assert (config.checkpoint.every, config.checkpoint.format, config.eval.every) == (9, "sharded", 5)


def test_a_check_across_sections_still_holds() -> None:
    with pytest.raises(ValueError, match="cuda_graph runs on one process"):
        TrainConfig.flat(cuda_graph=True, ep=2)
    with pytest.raises(ValueError, match="ep_balanced needs expert parallelism"):
        TrainConfig().replace(ep_balanced=True)


def test_a_run_saved_in_the_flat_layout_resumes(tmp_path, corpus_dir, small_config) -> None:
    config = small_config(tmp_path / "run", corpus_dir, max_steps=4, save_every=2, eval_every=2)
    Trainer(config, show_progress=False, log=lambda *_: None).train(stop_at=2)
    # Rewrite the run as an earlier k3 wrote it: the TrainConfig as one flat dict.
    state = load_checkpoint(tmp_path / "run")
    state["train"] = to_flat(config)
    save_checkpoint(tmp_path / "run" / "checkpoint.pt", state)
    (tmp_path / "run" / "train_config.json").write_text(json.dumps(to_flat(config)))
    resumed = Trainer(small_config(tmp_path / "run", corpus_dir), resume=True, show_progress=False,
                      log=lambda *_: None, resume_overrides={"max_steps": 4})
    assert resumed.config == config and resumed.step == 2
    assert resumed.train()["steps"] == 4


@pytest.mark.parametrize("saved, message", [
    ({"data": {"seq_len": "4096"}}, "DataConfig.seq_len must be int, got str"),
    ({"optim": {"lr": True}}, "OptimConfig.lr must be float, got bool"),
    ({"data": {"tokenizer": 3}}, "DataConfig.tokenizer must be str or None, got int"),
    ({"optim": {"lr": 1e-3, "evil": 1}}, "TrainConfig.optim has no field 'evil'"),
    ({"optim": {"lr": float("nan")}}, r"lr must be positive \(above 0\), got nan"),
    ({"data": {"seq_len": 0}}, "seq_len must be at least 1, got 0"),
])
def test_a_hostile_saved_config_is_refused_with_the_field_named(saved, message):
    """A checkpoint's saved settings may come from anyone: a wrong type or an unknown field is a ValueError that
    names it, before any of it reaches the trainer."""
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(saved)
