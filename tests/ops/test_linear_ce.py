"""The fused LM head + cross-entropy paths (k3.ops.linear_ce) against the plain one: loss and both gradients."""

from __future__ import annotations

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig
from k3.ops.linear_ce import (_fla_importable, is_dtensor, linear_cross_entropy_backend,
                              linear_cross_entropy_chunked, linear_cross_entropy_plain)

needs_cuda_fla = pytest.mark.skipif(not (torch.cuda.is_available() and _fla_importable()), reason="needs CUDA and fla")


def inputs(n=37, d=24, v=50, dtype=torch.float32, ignored=(3, 4, 20), seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, generator=gen) * 0.3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[list(ignored)] = -100
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels, **kwargs):
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    loss = fn(h, w, labels, **kwargs)
    (loss * 1.7).backward()  # a non-unit upstream gradient
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 4096])
def test_chunked_equals_plain_in_fp32(chunk_rows):
    hidden, weight, labels = inputs()
    expected = loss_and_grads(linear_cross_entropy_plain, hidden, weight, labels)
    got = loss_and_grads(linear_cross_entropy_chunked, hidden, weight, labels, chunk_rows=chunk_rows)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_is_as_close_to_fp32_as_plain_in_bf16():
    hidden, weight, labels = inputs(n=64, d=32, v=300)
    exact = loss_and_grads(linear_cross_entropy_plain, hidden, weight, labels)
    plain = loss_and_grads(linear_cross_entropy_plain, hidden.bfloat16(), weight.bfloat16(), labels)
    chunked = loss_and_grads(linear_cross_entropy_chunked, hidden.bfloat16(), weight.bfloat16(), labels,
                             chunk_rows=16)
    assert plain[1].dtype == chunked[1].dtype == chunked[2].dtype == torch.bfloat16
    for p, c, e in zip(plain, chunked, exact, strict=True):
        err_plain = ((p.float() - e).norm() / e.norm()).item()
        err_chunked = ((c.float() - e).norm() / e.norm()).item()
        assert err_chunked <= 2 * err_plain + 1e-3, (err_chunked, err_plain)


def test_hand_computed_loss():
    """Two rows, vocab 2, W = I: row [0, ln 3] with label 1 -> ln(1+3) - ln 3; row [0, 0] label 0 -> ln 2."""
    hidden = torch.tensor([[0.0, torch.log(torch.tensor(3.0))], [0.0, 0.0]])
    loss = linear_cross_entropy_chunked(hidden, torch.eye(2), torch.tensor([1, 0]), chunk_rows=1)
    expected = (torch.log(torch.tensor(4.0)) - torch.log(torch.tensor(3.0)) + torch.log(torch.tensor(2.0))) / 2
    torch.testing.assert_close(loss, expected)


def test_no_gradient_wanted_computes_the_loss_only():
    hidden, weight, labels = inputs()
    with torch.no_grad():
        got = linear_cross_entropy_chunked(hidden, weight, labels, chunk_rows=5)
        torch.testing.assert_close(got, linear_cross_entropy_plain(hidden, weight, labels))


@pytest.mark.parametrize("backend", ["chunked", "fla", "fused", "auto"])
def test_model_loss_by_backend_equals_the_plain_loss(backend, monkeypatch):
    """K3ForCausalLM(..., return_logits=False) takes the K3_LINEAR_CE path (fla falls back to chunked on CPU,
    fused and auto to plain)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    out = model(ids, labels=labels)
    out.loss.backward()
    expected_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    monkeypatch.setenv("K3_LINEAR_CE", backend)
    lean = model(ids, labels=labels, return_logits=False)
    assert lean.logits is None
    lean.loss.backward()
    torch.testing.assert_close(lean.loss, out.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.lm_head.weight.grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_unknown_backend_is_refused(monkeypatch):
    from k3.ops.linear_ce import linear_cross_entropy

    monkeypatch.setenv("K3_LINEAR_CE", "fast")
    with pytest.raises(ValueError, match="K3_LINEAR_CE='fast'; use auto, torch, fused, chunked or fla"):
        hidden, weight, labels = inputs()
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear_cross_entropy(hidden, head, labels)


def test_auto_takes_the_fused_path_on_cuda_only(monkeypatch):
    monkeypatch.delenv("K3_LINEAR_CE", raising=False)
    assert linear_cross_entropy_backend(on_cuda=False) == "torch"
    assert linear_cross_entropy_backend(on_cuda=True) == ("fused" if _fla_importable() else "torch")
    monkeypatch.setenv("K3_LINEAR_CE", "chunked")
    assert linear_cross_entropy_backend(on_cuda=True) == "chunked"


@needs_cuda_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_plain_on_cuda(dtype):
    """fla's cross-entropy on the logits, gradient in place, against F.cross_entropy on fp32 logits: the loss and
    both gradients, with ignored rows and a vocabulary that is not a power of two."""
    from k3.ops.linear_ce import linear_cross_entropy_fused

    hidden, weight, labels = inputs(n=300, d=64, v=5000, dtype=dtype)
    hidden, weight, labels = (t.detach().cuda() for t in (hidden, weight, labels))
    expected = loss_and_grads(linear_cross_entropy_plain, hidden, weight, labels)
    got = loss_and_grads(linear_cross_entropy_fused, hidden, weight, labels)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)


@needs_cuda_fla
def test_fused_loss_is_nan_when_every_label_is_ignored_as_plains_is():
    from k3.ops.linear_ce import linear_cross_entropy_fused

    hidden, weight, labels = inputs(n=8, d=16, v=100, ignored=range(8))
    hidden, weight, labels = (t.detach().cuda() for t in (hidden, weight, labels))
    assert linear_cross_entropy_plain(hidden, weight, labels).isnan()
    assert linear_cross_entropy_fused(hidden, weight, labels).isnan()


def test_a_sharded_head_is_told_apart_without_importing_dtensor_up_front(tmp_path):
    """is_dtensor: True for a DTensor weight (an FSDP-sharded head, which takes the plain path), False for a plain
    tensor; k3 itself does not import torch.distributed.tensor to ask (tests/ops/test_compile_constant.py)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        weight = distribute_tensor(torch.randn(8, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert is_dtensor(weight) and not is_dtensor(torch.randn(8, 4))
    finally:
        dist.destroy_process_group()
