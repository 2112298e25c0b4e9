import copy

import pytest
import torch
from torch import nn

from k3.checkpoint.native import load_checkpoint, model_from_checkpoint
from k3.train.master_weights import MasterWeightAdamW
from k3.train.metrics import read_metrics
from k3.train.optim import build_optimizer
from k3.train.trainer import Trainer


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))


def test_a_bf16_parameter_step_equals_fp32_adamw_on_the_masters():
    reference = small_net()
    model = copy.deepcopy(reference)
    masters = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1)
    plain = build_optimizer(reference, lr=1e-2, weight_decay=0.1)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(m, p) for m, p in zip(masters.masters, reference.parameters()))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator) for p in reference.parameters()]
        for p, q, g in zip(reference.parameters(), model.parameters(), grads):
            q.grad = g.to(torch.bfloat16)
            p.grad = g.to(torch.bfloat16).float()  # the same gradient the bf16 backward hands over
        torch.nn.utils.clip_grad_norm_(masters.take_grads(), 1.0)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        masters.step()
        plain.step()
        masters.zero_grad()
        # The masters take exactly fp32 AdamW's step; the parameters are the masters rounded to bf16.
        assert all(torch.equal(m, p) for m, p in zip(masters.masters, reference.parameters()))
        assert all(torch.equal(q, m.to(torch.bfloat16)) for q, m in zip(model.parameters(), masters.masters))
        assert all(q.grad is None for q in model.parameters())
    # Against the same steps from unrounded fp32 gradients: apart only by the gradients' bf16 rounding.
    unrounded = small_net()
    optimizer = build_optimizer(unrounded, lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in unrounded.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        torch.nn.utils.clip_grad_norm_(unrounded.parameters(), 1.0)
        optimizer.step()
    for m, p, start in zip(masters.masters, unrounded.parameters(), small_net().parameters()):
        moved = (p - start).abs().max()
        assert (m - p).abs().max() <= 0.02 * moved + 1e-6


def test_a_parameter_without_a_gradient_is_left_alone():
    model = small_net()
    masters = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    masters.take_grads()
    masters.step()
    assert not torch.equal(first, before[0])
    assert all(torch.equal(p, b) for p, b in zip(list(model.parameters())[1:], before[1:]))


def test_bf16_parameter_training_resumes_exactly_with_fp32_checkpoints(tmp_path, corpus_dir, small_config):
    """On the CPU, where a step is deterministic (the graphed CUDA twin: tests/train/test_graphed_step.py)."""
    unbroken = tmp_path / "unbroken"
    trainer = Trainer(small_config(unbroken, corpus_dir, master_weights="bf16-params", device="cpu"), show_progress=False)
    assert trainer.bf16_params and trainer.autocast is None
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    trainer.train()
    broken = tmp_path / "broken"
    Trainer(small_config(broken, corpus_dir, master_weights="bf16-params", device="cpu"), show_progress=False).train(stop_at=5)
    resumed = Trainer(small_config(broken, corpus_dir), resume=True, show_progress=False)
    assert resumed.bf16_params
    resumed.train()
    steps = lambda run: [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run / "metrics.jsonl")
                         if "loss" in r]
    assert steps(broken) == steps(unbroken) and len(steps(broken)) == 6
    a, b = load_checkpoint(unbroken), load_checkpoint(broken)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # The checkpoint holds the fp32 masters (not their bf16 rounding) and loads as any checkpoint does.
    weights = {k: v for k, v in a["model"].items() if k.endswith(".weight")}
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in weights.values())
    assert model_from_checkpoint(a).config.vocab_size == 320
    # The unbroken trainer's parameters are its masters rounded to bf16.
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, a["model"][name].to(torch.bfloat16))


def test_bf16_parameters_train_like_fp32(tmp_path, corpus_dir, small_config):
    runs = {}
    for mode in ("fp32-autocast", "bf16-params"):
        Trainer(small_config(tmp_path / mode, corpus_dir, master_weights=mode, max_steps=4, save_every=4,
                             device="cpu"),
                show_progress=False).train()
        runs[mode] = [r["loss"] for r in read_metrics(tmp_path / mode / "metrics.jsonl") if "loss" in r]
    assert runs["fp32-autocast"] != runs["bf16-params"]  # the forward really ran in bf16
    assert runs["bf16-params"] == pytest.approx(runs["fp32-autocast"], rel=0.02)


def test_the_cpu_default_keeps_fp32_parameters_and_bad_choices_are_refused(tmp_path, corpus_dir, small_config):
    trainer = Trainer(small_config(tmp_path / "run", corpus_dir, device="cpu"), show_progress=False)
    assert not trainer.bf16_params and all(p.dtype == torch.float32 for p in trainer.model.parameters())
    with pytest.raises(ValueError, match="master_weights must be one of"):
        small_config(tmp_path / "x", corpus_dir, master_weights="fp16")
    with pytest.raises(ValueError, match="bf16-params runs bf16 parameters in one process"):
        small_config(tmp_path / "y", corpus_dir, master_weights="bf16-params", dtype="fp32")
