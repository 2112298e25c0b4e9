"""QB's device-side solver (solve_batch_bias_on_device, for CUDA-graph captured training steps) against the
host-side one: the same bias and the same update count whenever the host solver stops within the device
solver's fixed number of updates, the most balanced iterate when neither balances, and no host read at all."""

import pytest
import torch

from k3.config import ModelConfig
from k3.layers.balancing import QB_MAX_ITERS, expert_load, maxvio, solve_batch_bias, solve_batch_bias_on_device
from k3.layers.moe import Router

E, K = 16, 2


def skewed_scores(tokens: int, seed: int, skew: float = 1.5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(tokens, E, generator=generator) + torch.linspace(-1.0, skew, E))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tolerance", [0.0, 0.01, 0.1])
def test_equals_the_host_solver_when_it_stops_within_the_updates(seed, tolerance):
    scores = skewed_scores(1024, seed)
    start = 0.1 * torch.randn(E, generator=torch.Generator().manual_seed(100 + seed))
    want, used = solve_batch_bias(scores, start, K, max_iters=200, tolerance=tolerance)
    assert 0 < used < 60, used
    got, got_used = solve_batch_bias_on_device(scores, start, K, updates=used + 5, tolerance=tolerance)
    assert torch.equal(got, want)
    assert int(got_used) == used


def test_already_balanced_batch_needs_no_update():
    scores = skewed_scores(1024, 7)
    solved, _ = solve_batch_bias(scores, torch.zeros(E), K, max_iters=200)
    got, used = solve_batch_bias_on_device(scores, solved, K, updates=3)
    want, host_used = solve_batch_bias(scores, solved, K, max_iters=3)
    assert host_used == 0 and int(used) == 0
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed, skew, cap", [(3, 3.0, 3), (2, 1.5, 4), (1, 3.0, 5)])
def test_at_the_cap_it_returns_the_most_balanced_iterate_as_the_host_solver_does(seed, skew, cap):
    """Cases where the host solver hits its cap; in the last two its most balanced iterate is not the last."""
    scores = skewed_scores(2048, seed, skew=skew)
    want, host_used = solve_batch_bias(scores, torch.zeros(E), K, max_iters=cap)
    assert host_used == cap  # the cap bites
    got, used = solve_batch_bias_on_device(scores, torch.zeros(E), K, updates=cap)
    assert int(used) == cap
    assert torch.equal(got, want)
    plain = maxvio(expert_load(scores.topk(K, dim=-1).indices, E))
    assert maxvio(expert_load((scores + got).topk(K, dim=-1).indices, E)) < plain


@pytest.mark.parametrize("sync_every", [2, 4, 7])
@pytest.mark.parametrize("seed, skew, cap", [(0, 1.5, 200), (3, 1.5, 200), (3, 3.0, 3), (1, 3.0, 5), (2, 1.5, 4)])
def test_host_solver_checking_every_few_updates_gives_the_same_bias_and_count(sync_every, seed, skew, cap):
    """solve_batch_bias(sync_every=R): the stopping test read once per R updates (what the training forward
    does on a GPU) stops at the same iterate with the same count, at the cap too; it reads the device R times
    less often."""
    scores = skewed_scores(2048, seed, skew=skew)
    start = 0.1 * torch.randn(E, generator=torch.Generator().manual_seed(200 + seed))
    want, used = solve_batch_bias(scores, start, K, max_iters=cap, tolerance=0.01)
    reads = []
    real_bool = torch.Tensor.__bool__
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real_bool(t))
    try:
        got, got_used = solve_batch_bias(scores, start, K, max_iters=cap, tolerance=0.01, sync_every=sync_every)
    finally:
        monkeypatch.undo()
    assert got_used == used and torch.equal(got, want)
    assert len(reads) <= 1 + used // sync_every + 1


def test_host_solver_with_sync_every_on_an_already_balanced_batch():
    scores = skewed_scores(1024, 7)
    solved, _ = solve_batch_bias(scores, torch.zeros(E), K, max_iters=200)
    want, host_used = solve_batch_bias(scores, solved, K, max_iters=3)
    got, used = solve_batch_bias(scores, solved, K, max_iters=3, sync_every=4)
    assert used == host_used == 0 and torch.equal(got, want)


def test_no_host_read(monkeypatch):
    """The solver must not read a tensor back (a CUDA-graph capture fails on that): Tensor.item, tolist and
    __bool__ raise while it runs."""
    scores = skewed_scores(512, 5)

    def refuse(*args, **kwargs):
        raise AssertionError("the device-side solver read a tensor back to the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    bias, used = solve_batch_bias_on_device(scores, torch.zeros(E), K, updates=4, tolerance=0.01)
    monkeypatch.undo()
    assert bias.shape == (E,) and used.shape == ()


def test_router_takes_the_device_solver_when_asked_and_refuses_it_over_ranks():
    config = ModelConfig.from_preset("debug", num_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    host, device = Router(config).train(), Router(config).train()
    host.qb_max_iters = device.qb_max_iters = QB_MAX_ITERS  # the iterated rule, host and device solvers
    device.load_state_dict(host.state_dict())
    torch.nn.init.normal_(host.weight, std=0.3)
    device.weight.data.copy_(host.weight.data)
    device.qb_device_updates = 64
    x = torch.randn(256, config.hidden_size)
    a, b = host(x), device(x)
    assert torch.equal(a.topk_ids_TK, b.topk_ids_TK)
    assert torch.equal(host.e_score_correction_bias, device.e_score_correction_bias)
    assert isinstance(device.last_qb_iters, torch.Tensor) and int(device.last_qb_iters) == host.last_qb_iters
    device.reduce = lambda tensor, op: tensor
    with pytest.raises(ValueError, match="host-side solver"):
        device(x)
