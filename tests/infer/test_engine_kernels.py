"""Engine(kernels=...): the choices hold while the engine sets up, steps and scores, and nowhere else."""

import pytest
import torch

from k3 import kernels
from k3.config import ModelConfig
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM


def test_engine_applies_its_kernel_choices_around_its_work_only(monkeypatch):
    monkeypatch.delenv("K3_MOE_BACKEND", raising=False)
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    seen = []
    for module in model.modules():  # the engine runs the model's parts, not always the model itself
        module.register_forward_pre_hook(lambda module, args: seen.append(kernels.choice("moe")))
    engine = Engine(model, None, max_context=64, max_batch=2, page_size=16, prefill_chunk=16,
                    kernels={"moe": "loop"})
    assert engine.kernels == {"moe": "torch"} and kernels.choice("moe") == "auto"
    engine.generate_ids([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0.0))
    engine.score([[1, 2, 3, 4]], [1])
    assert seen and set(seen) == {"torch"}
    assert kernels.choice("moe") == "auto"


def test_engine_rejects_an_unknown_kernel_choice_before_building_anything():
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    with pytest.raises(ValueError, match="moe='fast'; use auto, torch, grouped or triton"):
        Engine(model, None, max_context=64, max_batch=2, kernels={"moe": "fast"})
