"""`k3 convert` keeps the vision tower and projector (`vision_tower.*`, `mm_projector.*`) both ways: a native
checkpoint of a multimodal run -> kimi_k3 -> native is equal, tensor for tensor."""

from __future__ import annotations

import json

import pytest
import torch

from k3.checkpoint import native
from k3.cli import main
from k3.config import ModelConfig
from k3.model import K3ForCausalLM
from k3.checkpoint.hf_vision import load_vision
from k3.vision.config import VisionConfig
from k3.vision.model import VisionModel


@pytest.fixture
def multimodal_run(tmp_path):
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    vision = VisionModel(VisionConfig.from_preset("tiny", text_hidden_size=model.config.hidden_size)).eval()
    with torch.no_grad():  # no tensor left at its init value (norm gains at one, biases at zero)
        for param in vision.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    native.save_checkpoint(tmp_path / "run" / "checkpoint.pt",
                           {"model": model.state_dict(), "config": model.config.to_dict(), "step": 3,
                            "vision": vision.state_dict(), "vision_config": vision.config.to_dict(),
                            "media_token_id": 250})
    return tmp_path / "run", model, vision


def test_native_to_k3_and_back_keeps_the_vision_part_equal(multimodal_run, tmp_path, capsys):
    run, model, vision = multimodal_run
    assert main(["convert", "--from", str(run), "--to", str(tmp_path / "hf"), "--format", "kimi_k3"]) == 0
    assert "vision tower and projector" in capsys.readouterr().out
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert raw["media_placeholder_token_id"] == 250 and "vision_config" in raw
    loaded = load_vision(tmp_path / "hf")
    assert loaded.config == vision.config
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in vision.state_dict().items())

    assert main(["convert", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "back"),
                 "--format", "native"]) == 0
    state = native.load_checkpoint(tmp_path / "back")
    assert state["media_token_id"] == 250 and VisionConfig.from_dict(state["vision_config"]) == vision.config
    assert state["vision"].keys() == vision.state_dict().keys()
    assert all(torch.equal(state["vision"][k], v) for k, v in vision.state_dict().items())
    assert any(k.startswith("vision_tower.") for k in state["vision"])
    assert any(k.startswith("mm_projector.") for k in state["vision"])
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


def test_kimi_linear_refuses_a_model_with_a_vision_tower(multimodal_run, tmp_path, capsys):
    run, _, _ = multimodal_run
    assert main(["convert", "--from", str(run), "--to", str(tmp_path / "hf"), "--format", "kimi_linear"]) == 1
    assert "has a vision tower" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_multimodal_run_loads_as_one_model(multimodal_run, tmp_path):
    from k3.checkpoint.run import load_run_multimodal

    run, model, vision = multimodal_run
    multimodal, state = load_run_multimodal(run)
    assert multimodal.media_token_id == 250 and state["step"] == 3 and "vision" not in state
    assert all(torch.equal(multimodal.vision.state_dict()[k], v) for k, v in vision.state_dict().items())
    assert all(torch.equal(multimodal.language_model.state_dict()[k], v) for k, v in model.state_dict().items())
    native.save_checkpoint(tmp_path / "text" / "checkpoint.pt",
                           {"model": model.state_dict(), "config": model.config.to_dict(), "step": 1})
    with pytest.raises(ValueError, match="holds no vision tower"):
        load_run_multimodal(tmp_path / "text")
