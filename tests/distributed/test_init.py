"""Initialisation of models built on the meta device: both init_weights and the seeded, layout-independent
init write every tensor, and a model built sharded (FSDP2, EP) gets exactly the weights one process gets
from the same seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3.config import ModelConfig
from k3.distributed.init import init_weights_seeded
from k3.model import K3ForCausalLM
from tests.distributed.launching import run_launch, torchrun

WORKER = Path(__file__).with_name("init_worker.py")


def meta_built_debug_model(init) -> K3ForCausalLM:
    """Built on the meta device, given NaN-filled storage, then initialised by init(model) alone."""
    with torch.device("meta"):
        model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.fill_(float("nan"))
    init(model)
    return model


def seeded_debug_model(seed: int) -> K3ForCausalLM:
    return meta_built_debug_model(lambda model: init_weights_seeded(model, seed))


def test_init_weights_writes_every_parameter_and_buffer():
    model = meta_built_debug_model(K3ForCausalLM.init_weights)
    unwritten = [name for name, t in list(model.named_parameters()) + list(model.named_buffers())
                 if not torch.isfinite(t).all()]
    assert not unwritten, f"init_weights left these untouched: {unwritten}"


def test_seeded_init_writes_everything_and_depends_on_the_seed_only():
    a, b, c = seeded_debug_model(5).state_dict(), seeded_debug_model(5).state_dict(), seeded_debug_model(6).state_dict()
    assert all(torch.isfinite(v).all() for v in a.values()), [k for k, v in a.items() if not torch.isfinite(v).all()]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.1.block_sparse_moe.w1"], c["model.layers.1.block_sparse_moe.w1"])
    std = ModelConfig.from_preset("debug").initializer_range
    experts = a["model.layers.1.block_sparse_moe.w1"]
    assert abs(float(experts.std()) - std) < 0.1 * std  # normal(0, std), as init_weights draws
    assert len({float(experts[e].sum()) for e in range(experts.shape[0])}) == experts.shape[0]  # distinct experts
    queries = [k for k in a if k.endswith("_res.proj.weight")]
    assert queries and all(float(a[k].abs().max()) == 0 for k in queries)  # AttnRes pseudo-queries start at 0


@pytest.fixture(scope="module")
def sharded_builds(tmp_path_factory) -> Path:
    """Both layouts (EP=2, and EP=1: FSDP only) built on 2 ranks in one launch; their states in this folder."""
    out_dir = tmp_path_factory.mktemp("sharded_init")
    run_launch(torchrun(2) + [str(WORKER), "2,1", "3", str(out_dir)], "sharded init, ep 2 and 1", 600)
    return out_dir


@pytest.mark.parametrize("ep", [2, 1])
def test_sharded_build_equals_the_single_process_init(sharded_builds, ep):
    saved = torch.load(sharded_builds / f"state_ep{ep}.pt", weights_only=True)
    reference = seeded_debug_model(3).state_dict()
    assert sorted(saved["state"]) == sorted(reference)
    assert all(torch.equal(saved["state"][k], reference[k]) for k in reference)
    # Rank 0 held only its shards: fewer parameter elements than the whole model.
    whole = sum(p.numel() for p in seeded_debug_model(3).parameters())
    assert saved["local_numel_rank0"] < 0.7 * whole
