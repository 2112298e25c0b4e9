"""Fused projection weights (k3.layers.fused_weights): one buffer per group of projections of one input, the
weights views of it. Held equal to the separate projections; updates in place reach the buffer; anything that
replaces a weight, or a forward that wants gradients, falls back to the separate projections."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig
from bench.static_decode import StaticCache, decode_step
from k3.layers.fused_weights import FUSED_ATTR, fuse_model_weights, fused, unfuse_model_weights
from k3.layers.kda import KimiDeltaAttention
from k3.layers.moe import LatentMoE
from k3.ops.short_conv import short_conv_step, short_conv_torch

TOL = dict(rtol=1e-5, atol=1e-5)


def make_model(seed: int = 0, **overrides) -> K3ForCausalLM:
    torch.manual_seed(seed)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", **overrides)).eval()
    with torch.no_grad():  # weights far from init so that every projection matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.requires_grad_(False)


def all_groups(model) -> list:
    return [g for m in model.modules() for g in m.__dict__.get(FUSED_ATTR, {}).values()]


def logits_and_decode(model, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """Full-forward logits, then `steps` decode steps through a StaticCache (the decode shapes)."""
    with torch.no_grad():
        out = [model(ids).logits]
        hybrid = model.new_cache(ids.shape[0])
        model(ids[:, :-steps], cache=hybrid)
        static = StaticCache.from_hybrid(model.config, hybrid, ids.shape[1] + 4, dtype=torch.float32)
        for t in range(steps):
            out.append(decode_step(model, static, ids[:, -steps + t:][:, :1]))
    return out


def assert_same_outputs(model, reference, batch: int, length: int, seed: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    for got, expected in zip(logits_and_decode(model, ids), logits_and_decode(reference, ids), strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_fused_model_equals_the_unfused_one_in_forward_and_decode():
    model = make_model()
    reference = copy.deepcopy(model)
    counts = fuse_model_weights(model)
    types = model.config.layer_types
    assert counts["kda"] == counts["kda_conv"] == types.count("kda") and counts["mla"] == types.count("mla")
    moe_layers = sum(isinstance(m, LatentMoE) for m in model.modules())
    assert counts["experts"] == counts["moe_input"] == counts["moe_output"] == moe_layers > 0
    assert counts["mlp"] == types.count("kda") + types.count("mla") - moe_layers  # the dense layers' MLPs alone
    assert all(g.usable() for g in all_groups(model))
    assert_same_outputs(model, reference, batch=2, length=12, seed=1)


def test_fused_decode_convolves_q_k_v_as_one_and_slides_the_joined_window_in_place(monkeypatch):
    """With fused weights, q, k and v leave the GEMM side by side: prefill runs one conv over the three (weights
    from the conv group's buffer), and each decode token one step that reads the static cache's joined window
    where it lies and slides it there (k3.ops.conv_step_triton), with no window stored back."""
    from bench.static_decode import StaticKDASlot
    import k3.layers.kda as kda_module

    model = make_model()
    reference = copy.deepcopy(model)
    fuse_model_weights(model)
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    assert fused(kda, "conv").buffer.data_ptr() == kda.q_conv1d.weight.data_ptr()
    stored, widths, windows = [], [], []
    original_update, original_conv = StaticKDASlot.update_conv_tails, kda_module.short_conv
    original_step = kda_module.short_conv_step_inplace

    def update(self, tails):
        stored.append(type(tails))
        return original_update(self, tails)

    def conv(x, *args, **kwargs):
        widths.append(x.shape[-1])
        return original_conv(x, *args, **kwargs)

    def step(x, weight_CW, window, rows, parts):
        windows.append((x.shape[-1], tuple(window.shape[1:]), parts))
        return original_step(x, weight_CW, window, rows, parts)

    monkeypatch.setattr(StaticKDASlot, "update_conv_tails", update)
    monkeypatch.setattr(kda_module, "short_conv", conv)
    monkeypatch.setattr(kda_module, "short_conv_step_inplace", step)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    got = logits_and_decode(model, ids, steps=2)
    width = kda.q_proj.out_features
    n_kda = model.config.layer_types.count("kda")
    taps = model.config.kda_conv_kernel
    # StaticCache.from_hybrid copies the prefilled HybridCache's three tails in; decode stores none.
    assert stored == [tuple] * n_kda
    assert widths and set(widths) == {3 * width}  # one conv over q, k and v in prefill
    assert windows == [(3 * width, (taps - 1, 3 * width), 3)] * (2 * n_kda)  # and one step per layer and token
    stored.clear()
    monkeypatch.setattr(kda_module, "short_conv", original_conv)
    for a, b in zip(got, logits_and_decode(reference, ids, steps=2), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert len(stored) == 3 * n_kda and all(t is tuple for t in stored)  # unfused: three projections, three tails


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need Triton's interpreter")
def test_compiled_fused_decode_through_the_conv_kernel_equals_the_twin(monkeypatch):
    """The conv step's Triton kernel (interpreted) inside a functionalised compiled decode step: the custom op
    declares its write to the cache's window, so the window after each step and the logits equal the PyTorch
    twin's, eager."""
    pytest.importorskip("triton")
    model = make_model(num_layers=2, full_attn_layers=[2])  # one KDA layer, one MLA: half the preset's trace
    fuse_model_weights(model)
    ids = torch.randint(0, model.config.vocab_size, (3, 8), generator=torch.Generator().manual_seed(5))

    def prefilled():
        hybrid = model.new_cache(ids.shape[0])
        with torch.no_grad():
            model(ids[:, :-2], cache=hybrid)
        return StaticCache.from_hybrid(model.config, hybrid, ids.shape[1] + 4, dtype=torch.float32)

    monkeypatch.setenv("K3_CONV_STEP_BACKEND", "torch")
    twin = prefilled()
    with torch.no_grad():
        expected = [decode_step(model, twin, ids[:, t:t + 1]) for t in (6, 7)]
    monkeypatch.setenv("K3_CONV_STEP_BACKEND", "triton")
    cache = prefilled()
    step = torch.compile(decode_step, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        for t, want in zip((6, 7), expected, strict=True):
            torch.testing.assert_close(step(model, cache, ids[:, t:t + 1]), want, **TOL)
    for got, want in zip(cache.layers, twin.layers, strict=True):
        if hasattr(got, "conv_window"):
            torch.testing.assert_close(got.conv_window, want.conv_window, **TOL)
            torch.testing.assert_close(got.state, want.state, **TOL)
    torch._dynamo.reset()


def test_fusing_keeps_names_shapes_and_values_and_is_idempotent():
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_model_weights(model)
    groups = all_groups(model)
    fuse_model_weights(model)
    assert all_groups(model) == groups  # the same groups, not new buffers
    after = model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert after[name].shape == value.shape and torch.equal(after[name], value), name
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    group = fused(kda, "input")
    assert group.buffer.data_ptr() == kda.q_proj.weight.data_ptr()  # the weights live in the buffer
    assert unfuse_model_weights(model) == len(groups) and not all_groups(model)
    for p in kda._input_projections():  # each weight in its own storage again
        assert p.weight.untyped_storage().nbytes() == p.weight.nbytes
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]) and value.is_contiguous(), name


def test_in_place_updates_reach_the_fused_buffer():
    """An optimizer step or load_state_dict (both in place) changes what the fused GEMMs compute."""
    model, reference = make_model(), make_model()
    fuse_model_weights(model)
    new_state = make_model(seed=5).state_dict()
    model.load_state_dict(new_state)
    reference.load_state_dict(new_state)
    with torch.no_grad():
        for m in (model, reference):
            kda = next(x for x in m.modules() if isinstance(x, KimiDeltaAttention))
            kda.v_proj.weight.mul_(1.5)
            moe = next(x for x in m.modules() if isinstance(x, LatentMoE))
            moe.w3.add_(0.05)
    assert all(g.usable() for g in all_groups(model))
    assert_same_outputs(model, reference, batch=1, length=10, seed=2)


def test_replaced_weights_fall_back_to_the_separate_projections():
    model = make_model()
    fuse_model_weights(model)
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    kda.k_proj.weight = torch.nn.Parameter(kda.k_proj.weight.detach().clone() * 2, requires_grad=False)
    assert fused(kda, "input") is None  # k_proj no longer lives in the buffer: its new values must be used
    reference = make_model()
    with torch.no_grad():
        next(m for m in reference.modules() if isinstance(m, KimiDeltaAttention)).k_proj.weight.mul_(2)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **TOL)
    model.double()  # a dtype change replaces every weight
    assert not any(g.usable() for g in all_groups(model))


def test_a_forward_that_wants_gradients_uses_the_parameters():
    model = make_model().requires_grad_(True)
    fuse_model_weights(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    model(ids).logits.square().mean().backward()
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    moe = next(m for m in model.modules() if isinstance(m, LatentMoE))
    for p in (kda.q_proj.weight, kda.b_proj.weight, moe.w1, moe.w3):
        assert p.grad is not None and p.grad.abs().sum() > 0
    with torch.no_grad():
        assert fused(kda, "input") is not None


def test_a_fused_model_saves_in_hugging_face_format(tmp_path):
    pytest.importorskip("safetensors")
    from k3.checkpoint.hf import from_pretrained
    from k3.checkpoint.hf_save import save_pretrained

    model = make_model()
    fuse_model_weights(model)
    save_pretrained(model, None, tmp_path / "hf")
    loaded = from_pretrained(tmp_path / "hf")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0, msg=name)


def test_engine_fuses_frozen_models_only_when_asked_or_with_graphs():
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    prompts = [[3, 9, 4, 1, 7], [8, 2, 6]]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    plain = make_model()
    expected = Engine(plain, max_context=32, max_batch=2, prefix_cache=False).generate_ids(prompts, params)
    assert not all_groups(plain)  # no graphs on the CPU: the default leaves the model alone
    model = make_model()
    got = Engine(model, max_context=32, max_batch=2, prefix_cache=False, fuse_weights=True).generate_ids(prompts,
                                                                                                          params)
    assert all_groups(model) and got == expected


@pytest.mark.parametrize("batch,width", [(1, 4), (3, 2), (2, 3)])
def test_decode_conv_step_equals_the_convolution(batch, width):
    gen = torch.Generator().manual_seed(batch * 10 + width)
    x = torch.randn(batch, 1, 16, generator=gen)
    weight = torch.randn(16, width, generator=gen)
    tail = torch.randn(batch, width - 1, 16, generator=gen)
    y, new_tail = short_conv_step(x, weight, tail)
    y_ref, tail_ref = short_conv_torch(x, weight, tail)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(new_tail, tail_ref, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped GEMM runs on CUDA")
def test_fused_experts_grouped_gemm_equals_the_separate_ones():
    from k3.ops.moe import experts_grouped_mm

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, f, d, n = 8, 64, 32, 40
    w13 = torch.randn(e, 2 * f, d, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.1
    w2 = torch.randn(e, d, f, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.1
    x = torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    counts = torch.tensor([5, 0, 7, 3, 9, 1, 15, 0], device="cuda")
    separate = experts_grouped_mm(x, counts, w13[:, :f], w13[:, f:], w2, "situ", (4.0, 25.0))
    one = experts_grouped_mm(x, counts, w13[:, :f], w13[:, f:], w2, "situ", (4.0, 25.0), w13)
    torch.testing.assert_close(one, separate, rtol=2e-2, atol=2e-2)


def test_engine_reads_each_layers_tail_window_once_per_step(monkeypatch):
    """In the engine's pool the joined window is a gather: a fused KDA layer reads it once per forward (one
    read per write-back), not once to test for it and once to use it."""
    from k3.infer.cache_pool import KDAView
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    reads, writes = [], []
    window, update = KDAView.conv_window, KDAView.update_conv_tails
    monkeypatch.setattr(KDAView, "conv_window", property(lambda self: reads.append(1) or window.fget(self)))
    monkeypatch.setattr(KDAView, "update_conv_tails", lambda self, tails: writes.append(1) or update(self, tails))
    engine = Engine(make_model(), max_context=32, max_batch=2, prefix_cache=False, fuse_weights=True)
    engine.generate_ids([[3, 9, 4, 1, 7], [8, 2, 6]], SamplingParams(max_new_tokens=4, temperature=0))
    assert writes and len(reads) == len(writes)


def _moe_and_input(seed: int = 6):
    model = make_model()
    moe = next(m for m in model.modules() if isinstance(m, LatentMoE))
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    return model, moe, x


def test_fused_moe_runs_its_four_projections_as_two_gemms(monkeypatch):
    """With the MoE groups fused, the latent down, shared gate and up projections are one GEMM, and the latent
    up and shared down projections one GEMM over their inputs side by side; no projection module runs."""
    model, moe, x = _moe_and_input()
    with torch.no_grad():
        expected = moe(x[None])
    fuse_model_weights(model)
    shared = moe.shared_experts
    assert fused(shared, "gate_up") is None  # its gate and up live in the MoE's input group instead
    assert fused(moe, "output").buffer.shape == (moe.routed_expert_up_proj.out_features,
                                                moe.routed_expert_up_proj.in_features + shared.down_proj.in_features)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a fused projection ran as its own module")

    for module in (moe.routed_expert_down_proj, moe.routed_expert_up_proj, shared, shared.gate_proj,
                   shared.up_proj, shared.down_proj):
        monkeypatch.setattr(module, "forward", must_not_run)
    gemms = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: gemms.append(tuple(w.shape))
                        or real_linear(x, w, b))
    with torch.no_grad():
        got = moe(x[None])
    assert fused(moe, "input").buffer.shape in gemms and fused(moe, "output").buffer.shape in gemms
    torch.testing.assert_close(got, expected, **TOL)


def test_a_hooked_moe_projection_runs_as_its_module():
    """A forward hook on any of the fused projections must see its module run: the layer falls back."""
    model, moe, x = _moe_and_input()
    with torch.no_grad():
        expected = moe(x[None])
    fuse_model_weights(model)
    seen = []
    moe.shared_experts.down_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        got = moe(x[None])
    assert seen == [(1, 5, model.config.hidden_size)]
    torch.testing.assert_close(got, expected, **TOL)
