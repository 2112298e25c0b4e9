"""Checkpoint files from elsewhere, and saves that go wrong: each test one hostile or careless property, and
what k3 does about it (refuses with a message, or cleans up only what it wrote)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.checkpoint import native
from k3.checkpoint.hf import from_pretrained, save_pretrained
from k3.config import ModelConfig
from k3.model import K3ForCausalLM


@pytest.fixture
def model():
    return K3ForCausalLM(ModelConfig.from_preset("debug")).eval()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temp_files_of_a_killed_save_are_removed_by_the_next_one(tmp_path, model):
    path = tmp_path / "checkpoint.pt"
    stale = tmp_path / f".checkpoint.pt.{_dead_pid()}.abc123.tmp"
    stale.write_bytes(b"PK half a checkpoint")
    live = tmp_path / f".checkpoint.pt.{os.getpid()}.def456.tmp"  # a writer still running: not ours to touch
    live.write_bytes(b"in progress")
    other = tmp_path / ".checkpoint.pt.notes.tmp"  # not an atomic write's name
    other.write_bytes(b"mine")
    native.save_checkpoint(path, {"model": {}, "config": model.config.to_dict(), "step": 0})
    assert not stale.exists() and live.exists() and other.exists()
    assert native.load_checkpoint(path)["step"] == 0


def test_a_full_disk_is_reported_as_such(tmp_path, monkeypatch):
    def enforce_fail(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    monkeypatch.setattr(native.torch, "save", enforce_fail)
    with pytest.raises(RuntimeError, match="MiB free: a full disk is the usual cause"):
        native.save_checkpoint(tmp_path / "checkpoint.pt", {"step": 0})
    assert not list(tmp_path.iterdir())


def test_nan_weights_in_a_native_checkpoint_are_refused(tmp_path, model):
    state = model.state_dict()
    state["model.norm.weight"] = state["model.norm.weight"].clone().fill_(float("nan"))
    native.save_checkpoint(tmp_path / "checkpoint.pt", {"model": state, "config": model.config.to_dict(), "step": 0})
    with pytest.raises(ValueError, match="model.norm.weight holds .* NaN or infinite"):
        native.model_from_checkpoint(native.load_checkpoint(tmp_path), "run")


def test_nan_weights_in_an_hf_directory_are_refused(tmp_path, model):
    directory = save_pretrained(model, None, tmp_path / "hf", format="kimi_k3", progress=False)
    tensors = load_file(directory / "model.safetensors")
    name = next(n for n in tensors if n.endswith("norm.weight"))
    tensors[name] = tensors[name].clone().fill_(float("inf"))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="NaN or infinite"):
        from_pretrained(directory, progress=False)


def test_an_index_entry_outside_the_directory_is_refused(tmp_path, model):
    directory = save_pretrained(model, None, tmp_path / "hf", format="kimi_k3", max_shard_size="100KB",
                                progress=False)
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = next(iter(index["weight_map"]))
    outside = tmp_path / "elsewhere.safetensors"
    save_file({first: torch.zeros(1)}, outside)
    index["weight_map"][first] = "../elsewhere.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lies outside"):
        from_pretrained(directory, progress=False)


def test_a_symlinked_weights_file_out_of_the_directory_is_refused(tmp_path, model):
    directory = save_pretrained(model, None, tmp_path / "hf", format="kimi_k3", progress=False)
    real = tmp_path / "real.safetensors"
    os.replace(directory / "model.safetensors", real)
    os.symlink(real, directory / "model.safetensors")
    with pytest.raises(ValueError, match="lies outside"):
        from_pretrained(directory, progress=False)


def test_a_json_list_as_config_is_refused(tmp_path, model):
    directory = save_pretrained(model, None, tmp_path / "hf", format="kimi_k3", progress=False)
    (directory / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="holds a JSON list; a model config is a JSON object"):
        from_pretrained(directory, progress=False)


def test_a_config_with_more_experts_than_the_files_hold_is_refused_before_allocating(tmp_path, model, monkeypatch):
    """config.json is a stranger's too: 10^7 experts against the files' 8 would allocate each stacked expert tensor
    at the config's size (here 40 GB a tensor) before finding the rest missing. Refused from the names alone."""
    from k3.checkpoint import hf_load

    directory = save_pretrained(model, None, tmp_path / "hf", format="kimi_k3", progress=False)
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["num_experts"] = 10**7
    (directory / "config.json").write_text(json.dumps(config))
    real_assembler = hf_load._Assembler
    assemblers = []
    monkeypatch.setattr(hf_load, "_Assembler", lambda *a, **k: assemblers.append(real_assembler(*a, **k))
                        or assemblers[-1])
    with pytest.raises(ValueError, match="holds 8 of the 10000000 experts"):
        from_pretrained(directory, progress=False)
    assert all(not assembler.tensors for assembler in assemblers)  # nothing read, nothing allocated


@pytest.mark.parametrize("field,value", [("vocab_size", 10**9), ("num_experts", 10**6), ("hidden_size", 10**6)])
def test_a_native_config_larger_than_its_weights_is_refused_before_allocating(tmp_path, model, field, value):
    """A native checkpoint's config is its author's: the model was built at the config's size (a 256 GB embedding
    for a vocabulary of 10^9; 27 s of initialising for a width of 10^6) before its shapes were compared. Now it is
    built on the meta device and the comparison comes first."""
    config = model.config.to_dict()
    config[field] = value
    native.save_checkpoint(tmp_path / "checkpoint.pt", {"model": model.state_dict(), "config": config, "step": 0})
    with pytest.raises(ValueError, match="shape mismatches"):
        native.model_from_checkpoint(native.load_checkpoint(tmp_path), "run")


def test_a_native_checkpoint_loads_as_it_did(tmp_path):
    """Built on the meta device and assigned: the same values, fp32 parameters from bf16 weights (as copying into
    a built model gave), gradients on, tied embeddings still one tensor."""
    for tie in (False, True):
        original = K3ForCausalLM(ModelConfig.from_preset("debug", tie_word_embeddings=tie)).eval()
        weights = {name: t.bfloat16() for name, t in original.state_dict().items()}
        native.save_checkpoint(tmp_path / "checkpoint.pt", {"model": weights, "config": original.config.to_dict(),
                                                            "step": 0})
        loaded = native.model_from_checkpoint(native.load_checkpoint(tmp_path), "run")
        assert all(p.dtype == torch.float32 and p.requires_grad and not p.is_meta for p in loaded.parameters())
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
        for name, t in loaded.state_dict().items():
            assert torch.equal(t, weights[name].float()), name
