"""Trainer(kernels=...): the choices hold while the trainer builds, trains and evaluates, and not after."""

import pytest

from k3 import kernels
from k3.train import trainer as trainer_module
from k3.train.trainer import Trainer


def test_trainer_applies_its_kernel_choices_while_it_works(small_config, corpus_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("K3_ADAMW", raising=False)
    monkeypatch.delenv("K3_LINEAR_CE", raising=False)
    at_build = []
    build_optimizer = trainer_module.build_optimizer

    def recording_build_optimizer(*args, **kwargs):
        at_build.append(kernels.choice("adamw"))
        return build_optimizer(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_optimizer", recording_build_optimizer)
    trainer = Trainer(small_config(tmp_path / "run", corpus_dir, max_steps=2, eval_every=2, save_every=2),
                      show_progress=False, kernels={"adamw": "torch", "linear_ce": "plain"})
    seen = []
    trainer.model.register_forward_pre_hook(lambda module, args: seen.append(kernels.choice("linear_ce")))
    trainer.train()
    assert at_build == ["torch"]
    assert seen and set(seen) == {"torch"}
    assert kernels.choice("adamw") == kernels.choice("linear_ce") == "auto"


def test_trainer_rejects_an_unknown_kernel_switch(small_config, corpus_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown kernel switch 'adam'"):
        Trainer(small_config(tmp_path / "run", corpus_dir), show_progress=False, kernels={"adam": "torch"})
