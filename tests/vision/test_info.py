"""`k3 info` reports the vision tower and projector beside (not inside) the text model's counts."""

from __future__ import annotations

import argparse
import json

from k3 import info_cli
from k3.model import count_parameters
from k3.config import ModelConfig
from k3.hf_config import to_hf_config
from k3.vision import VisionConfig, VisionModel, vision_config_to_hf


def info(argv: list[str], capsys) -> str:
    parser = argparse.ArgumentParser()
    info_cli.register(parser.add_subparsers())
    args = parser.parse_args(["info", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_k3_preset_counts_its_vision_tower_separately(capsys):
    report = json.loads(info(["--preset", "k3", "--json"], capsys))
    assert report["total_params"] == count_parameters(ModelConfig.from_preset("k3"))["total_params"]
    assert report["vision_params"] == report["vision_tower_params"] + report["mm_projector_params"]
    assert 0.40e9 < report["vision_params"] < 0.46e9  # "about 0.4B"
    assert report["mm_projector_params"] == 4096 * 4096 + 4096 * 7168 + 7168
    text = info(["--preset", "k3"], capsys)
    assert "vision params" in text and "patchmergerv2" in text


def test_config_file_vision_config_is_counted(tmp_path, capsys):
    vision = VisionConfig.from_preset("tiny")
    config = to_hf_config(ModelConfig.from_preset("tiny"), "kimi_k3")
    config["vision_config"] = vision_config_to_hf(vision)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    report = json.loads(info(["--config", str(path), "--json"], capsys))
    assert report["vision_params"] == sum(p.numel() for p in VisionModel(vision).parameters())
    assert "vision_params" not in json.loads(info(["--config", str(path), "--vision", "none", "--json"], capsys))
    assert "vision_params" not in json.loads(info(["--preset", "tiny", "--json"], capsys))
