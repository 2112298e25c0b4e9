"""k3.train.graphed_step: a training step's forward and backward replayed from one CUDA graph gives the eager
step's loss and gradients (debug model, fp32 weights under bf16 autocast as the trainer runs it, QB routers); new
batches are copied in; wrong input is refused with a message. The capture itself needs a GPU; on CPU only the
refusals run. (Plain fp32 does not capture: its experts take the loop over experts, which reads the counts on the
host; the grouped GEMM that captures is bf16.)"""

import math

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig
from k3.layers.moe import Router
from k3.train.graphed_step import GraphedTrainStep

CUDA = torch.cuda.is_available()


def loss_fn(model, batch):
    return model(batch["ids"], labels=batch["ids"], return_logits=False).loss


def autocast_loss_fn(model, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return loss_fn(model, batch)


def test_cpu_batches_are_refused_with_the_reason():
    model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        GraphedTrainStep(model, loss_fn, {"ids": torch.zeros(1, 8, dtype=torch.long)})


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("qb_iters", [0, 64], ids=["published", "iterated"])
def test_replay_matches_the_eager_step_and_takes_new_batches(qb_iters):
    config = ModelConfig.from_preset("debug", moe_balancing="quantile")
    torch.manual_seed(0)
    eager = K3ForCausalLM(config).cuda().train()
    graphed = K3ForCausalLM(config).cuda().train()
    graphed.load_state_dict(eager.state_dict())
    for model in (eager, graphed):
        for _, router in model.routers():
            router.qb_max_iters = qb_iters
    if qb_iters:
        for _, router in eager.routers():
            router.qb_device_updates = 64  # the same solver both ways; it is exact once the batch balances
    generator = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (2, 64), device="cuda", generator=generator) for _ in range(3)]
    step = GraphedTrainStep(graphed, autocast_loss_fn, {"ids": batches[0]}, warmup=3, qb_updates=qb_iters or None)
    for ids in batches:
        want = autocast_loss_fn(eager, {"ids": ids})
        want.backward()
        got = step({"ids": ids})
        # The same kernels in the same order; bf16 leaves room only for atomics' order in some backward kernels.
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-4)
        for (name, a), b in zip(graphed.named_parameters(), eager.parameters()):
            if b.grad is None:
                assert a.grad is None, name
                continue
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-2, atol=1e-4, msg=name)
        for model in (eager, graphed):
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-2)
            model.zero_grad(set_to_none=True)
            model.update_balancers()  # published QB: the bias for the next step
        for (_, a), (_, b) in zip(graphed.routers(), eager.routers()):
            torch.testing.assert_close(a.e_score_correction_bias, b.e_score_correction_bias)
    routers = [m for m in graphed.modules() if isinstance(m, Router)]
    if qb_iters:
        assert routers and all(isinstance(r.last_qb_iters, torch.Tensor) for r in routers)
    else:
        assert routers and all(r.last_qb_iters == 1 for r in routers)
        assert any(float(r.e_score_correction_bias.abs().sum()) > 0 for r in routers)
    with pytest.raises(ValueError, match="captured for"):
        step({"ids": batches[0][:, :32]})


def test_trainer_refuses_cuda_graph_off_cuda_and_over_ranks(tmp_path, corpus_dir, small_config):
    from k3.train.trainer import Trainer

    with pytest.raises(ValueError, match="one process"):
        small_config(tmp_path / "a", corpus_dir, cuda_graph=True, ep=2)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Trainer(small_config(tmp_path / "b", corpus_dir, cuda_graph=True, device="cpu"), show_progress=False)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("master_weights", ["bf16-params", "fp32-autocast"])
def test_trainer_with_cuda_graph_learns_and_resumes(tmp_path, corpus_dir, small_config, master_weights):
    """Weighted recall rows in some batches and not others, evaluation between steps, a resume: the graphed
    run learns, and its resumed half gives the unbroken run's losses; with bf16 parameters (the CUDA default)
    and with fp32 ones under autocast."""
    from k3.train.metrics import read_metrics
    from k3.train.trainer import Trainer

    def losses(run):
        return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}

    unbroken = tmp_path / "unbroken"
    summary = Trainer(small_config(unbroken, corpus_dir, max_steps=12, eval_every=6, save_every=6, device="cuda",
                                   cuda_graph=True, master_weights=master_weights), show_progress=False).train()
    assert summary["last_val_loss"] < summary["first_val_loss"] - 0.5
    broken = tmp_path / "broken"
    config = small_config(broken, corpus_dir, max_steps=12, eval_every=6, save_every=6, device="cuda",
                          cuda_graph=True, master_weights=master_weights)
    Trainer(config, show_progress=False).train(stop_at=6)
    Trainer(config, resume=True, show_progress=False).train()
    want, got = losses(unbroken), losses(broken)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert math.isclose(got[step], want[step], rel_tol=1e-4), (step, got[step], want[step])


@pytest.mark.parametrize("weighted", [False, True])
def test_the_captured_rows_loss_equals_the_packed_loss_for_rows_of_one_document(tmp_path, corpus_dir, small_config,
                                                                                 weighted):
    """What --cuda-graph captures (the rows' loss, no cu_seqlens) is the packed step's loss when no row holds
    a document boundary, with and without loss weights (recall rows); runs on CPU."""
    import numpy as np

    from k3.data.packing import pack_rows
    from k3.train.trainer import Trainer

    trainer = Trainer(small_config(tmp_path / "run", corpus_dir), show_progress=False)
    generator = np.random.default_rng(0)
    length, vocab = trainer.seq_len, trainer.model_config.vocab_size
    rows = []
    for i in range(2):
        ids = generator.integers(1, vocab, length)
        labels = np.concatenate([ids[1:], [-100]])
        rows.append((ids, labels, generator.uniform(0.5, 2.0, length)) if weighted and i == 0 else (ids, labels))
    batch = pack_rows(rows, eos_token_id=None)
    assert (batch.weights is not None) == weighted
    trainer.model.eval()  # the bias frozen: both forwards route alike
    with torch.no_grad():
        packed = trainer._forward(batch)
        as_rows = trainer._rows_loss(trainer.model, trainer._rows(batch))
    assert as_rows.shape == () and torch.isfinite(as_rows)
    torch.testing.assert_close(as_rows, packed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_captured_loss_keeps_documents_apart_as_the_packed_step_does(tmp_path, corpus_dir, small_config,
                                                                         weighted):
    """What the default CUDA step captures (rows with cu_seqlens padded to a static count, no host sync) is the
    eager packed step's loss and gradients when rows hold several documents, with and without loss weights
    (the graph itself: bench/gpu_check.py). Same math, so fp32 on any device: on CUDA the two forms run different
    kernels (one masked attention over rows against one call per document), whose bf16 gradients differ by a
    bf16 rounding; and KDA's scan is its twin there, as fla's fp32 dots round in TF32 (and compile for minutes)."""
    import numpy as np

    from k3 import kernels
    from k3.data.packing import pack_rows
    from k3.train.trainer import Trainer

    trainer = Trainer(small_config(tmp_path / "run", corpus_dir, dtype="fp32"), show_progress=False)
    assert not trainer.bf16_params and trainer.autocast is None
    eos = trainer.tokenizer.eos_token_id
    generator = np.random.default_rng(0)
    length, vocab = trainer.seq_len, trainer.model_config.vocab_size
    rows = []
    for i in range(2):
        ids = generator.integers(1, vocab, length)
        ids[ids == eos] = eos + 1 if eos + 1 < vocab else 1
        ids[[5, 6, length // 2]] = eos  # three documents (one of a single token) after the row's first
        labels = np.concatenate([ids[1:], [-100]])
        labels[ids == eos] = -100
        rows.append((ids, labels, generator.uniform(0.5, 2.0, length)) if weighted and i == 0 else (ids, labels))
    batch = pack_rows(rows, eos_token_id=eos)
    assert batch.cu_seqlens.numel() - 1 == 8
    model = trainer.model.eval()  # the bias frozen: both forwards route alike

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        with kernels.use(kda="torch"):
            loss = fn()
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_grads = loss_and_grads(lambda: trainer._forward(batch))
    captured = trainer._rows(batch)
    assert captured["cu_seqlens"].shape == (trainer.max_documents(2) + 1,)
    got, got_grads = loss_and_grads(lambda: trainer._rows_loss(model, captured))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_step_choice_the_flags_and_the_cpu_default(tmp_path, corpus_dir, small_config):
    """--eager / --cuda-graph set TrainConfig.cuda_graph (mutually exclusive); unset, a CUDA device in one process
    takes the graphed step and anything else the eager one."""
    import argparse

    from k3.train.cli import register
    from k3.train.trainer import Trainer

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["train", "--out", "x", "--eager"]).cuda_graph is False
    assert parser.parse_args(["train", "--out", "x", "--cuda-graph"]).cuda_graph is True
    assert parser.parse_args(["train", "--out", "x"]).cuda_graph is None
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--out", "x", "--eager", "--cuda-graph"])
    trainer = Trainer(small_config(tmp_path / "cpu", corpus_dir, device="cpu"), show_progress=False)
    assert trainer.config.cuda_graph is None and trainer.graph_step is False
