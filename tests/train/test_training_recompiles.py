"""The compiled pieces of a training step (the AttnRes mix, the GLU activation: what CUDA runs compiled) compile
during the first step and never again, whatever the sequence length of later batches. Forced onto the CPU here
(Inductor), on the tiny preset, which has both."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from k3 import K3ForCausalLM, ModelConfig
from k3.ops.attn_res import set_attn_res_backend


def test_new_sequence_lengths_compile_nothing_after_the_first_step(monkeypatch):
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("tiny")).train()
    monkeypatch.setenv("K3_GLU_BACKEND", "compiled")
    set_attn_res_backend("compiled")
    try:
        frames = []
        for length in (24, 40, 72, 131):
            ids = torch.randint(0, model.config.vocab_size, (2, length))
            model(ids, labels=ids, return_logits=False).loss.backward()
            frames.append(counters["frames"]["ok"])
    finally:
        set_attn_res_backend(None)
    assert frames[0] > 0  # the compiled paths were taken
    assert frames[1:] == [frames[0]] * 3, frames
