"""Every cache a KDA or MLA layer is given satisfies k3.cache.KDASlot / MLASlot (the layers read its flags and
methods, never probe for them), and a slot without an in-place form says so when asked for one."""

import pytest
import torch

from k3 import ModelConfig
from k3.cache import HybridCache, KDASlot, MLASlot
from k3.infer.cache_pool import BatchCache, CachePool
from bench.static_decode import StaticCache


def slots_of(cache, config: ModelConfig) -> tuple[object, object]:
    kinds = config.layer_types
    return cache[kinds.index("kda")], cache[kinds.index("mla")]


@pytest.mark.parametrize("kind", ["hybrid", "pool_decode", "pool_prefill", "static"])
def test_every_cache_slot_satisfies_the_protocols(kind):
    config = ModelConfig.from_preset("debug")
    if kind == "hybrid":
        cache = HybridCache(config.layer_types, batch_size=2)
    elif kind == "static":
        cache = StaticCache(config, 2, 16, "cpu", torch.float32)
    else:
        pool = CachePool(config, num_slots=3, num_pages=4, page_size=4, device="cpu", dtype=torch.float32)
        cache = BatchCache(pool, torch.tensor([1, 2]), torch.tensor([[1, 2], [3, 4]]), torch.tensor([0, 0]),
                           mask_rows=kind == "pool_decode")
    kda, mla = slots_of(cache, config)
    assert isinstance(kda, KDASlot) and isinstance(mla, MLASlot)
    assert kda.in_place == (kind != "hybrid")
    assert mla.pages_in_place == (kind == "pool_decode")


def test_a_growing_slot_refuses_in_place_use_by_name():
    config = ModelConfig.from_preset("debug")
    kda, mla = slots_of(HybridCache(config.layer_types, batch_size=1), config)
    with pytest.raises(TypeError, match="KDACacheSlot .* no in-place form"):
        kda.state_in_place()
    with pytest.raises(TypeError, match="MLACacheSlot .* no in-place form"):
        mla.append_in_place(torch.zeros(1, 1, config.kv_lora_rank), torch.zeros(1, 1, config.qk_rope_head_dim))
