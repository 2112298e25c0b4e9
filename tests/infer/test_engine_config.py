"""EngineConfig and plan_engine: what the engine decides from its settings, the model and the device (CPU here)."""

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.engine import Engine
from k3.infer.engine_config import EngineConfig, plan_engine
from k3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug")).eval()


def test_defaults_on_cpu(model):
    plan = plan_engine(EngineConfig(max_context=256, max_batch=4, page_size=16), model)
    max_pages = 256 // 16
    assert (plan.prefill_chunk, plan.batch_tokens, plan.max_step_tokens) == (512, 2048, 2048 + 4)
    assert (plan.max_pages, plan.prefix_slots) == (max_pages, 4)
    assert plan.num_pages == 4 * max_pages + 4 * max_pages // 2
    assert plan.use_cuda_graphs is False and plan.fuse_weights is False and plan.dtype == torch.float32
    assert plan.overlap_steps is False  # a CPU step is done when it returns: nothing to overlap


def test_given_sizes_are_kept_and_a_chunk_is_whole_pages(model):
    config = EngineConfig(max_context=256, max_batch=2, page_size=16, prefill_chunk=40, max_step_tokens=99,
                          num_pages=7, prefix_cache=False)
    plan = plan_engine(config, model)
    assert (plan.prefill_chunk, plan.batch_tokens, plan.max_step_tokens) == (32, 128, 99)
    assert (plan.num_pages, plan.prefix_slots) == (7, 0)


def test_overlapped_steps_follow_graphed_decode_unless_set(model):
    """Left open, steps overlap where decode steps are CUDA-graph replays (the GPU's default); a setting wins."""
    assert plan_engine(EngineConfig(use_cuda_graphs=True), model).overlap_steps is True
    assert plan_engine(EngineConfig(use_cuda_graphs=True, overlap_steps=False), model).overlap_steps is False
    assert plan_engine(EngineConfig(overlap_steps=True), model).overlap_steps is True
    assert plan_engine(EngineConfig(record_routing=True), model).overlap_steps is False
    assert Engine(model, None, max_context=64, max_batch=2, overlap_steps=True).overlap_steps is True


def test_recording_routes_turns_off_graphs_and_the_prefix_cache(model):
    plan = plan_engine(EngineConfig(record_routing=True), model)
    assert plan.prefix_slots == 0 and plan.use_cuda_graphs is False
    with pytest.raises(ValueError, match="record_routing needs eager decode steps"):
        EngineConfig(record_routing=True, use_cuda_graphs=True)


@pytest.mark.parametrize("bad, message", [({"max_context": 1}, "max_context must be >= 2"),
                                          ({"max_batch": 0}, "max_batch must be >= 1")])
def test_bad_settings_are_refused_before_any_allocation(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def test_an_engine_takes_a_config_or_its_fields_as_keywords(model):
    config = EngineConfig(max_context=128, max_batch=2, page_size=16, prefill_chunk=32)
    from_config = Engine(model, None, config)
    from_keywords = Engine(model, None, max_context=128, max_batch=2, page_size=16, prefill_chunk=32)
    assert from_config.plan == from_keywords.plan and from_config.engine_config == config
    overridden = Engine(model, None, config, max_batch=3)  # keywords replace the config's fields
    assert overridden.max_batch == 3 and overridden.scheduler.prefill_chunk == 32 and config.max_batch == 2
    with pytest.raises(TypeError):
        Engine(model, None, max_contxt=128)
