"""What a rollout hands the trainer beyond tokens: the engine's routing, replayed by the training forward, and
parked partial rollouts, carried through a checkpoint (real engine, real sandboxes, a tiny model taught to call
tools)."""

import copy
import json

import pytest
import torch

from k3.rl.loop import RLConfig, RLTrainer
from k3.rl.rollout_engine import build_engine
from k3.rl.rollout import RolloutConfig, RolloutRunner
from k3.rl.tasks import task_from_dict
from tests.rl.callers import make_caller_run, say_tasks

TIMING = {"generation_s", "tool_s", "sandbox_setup_s", "verify_s", "rollout_tokens_per_s", "rollout_s", "train_s",
          "step_s", "sandbox_s"}


@pytest.fixture(scope="module")
def caller_run(sandbox_home, tokenizer, tmp_path_factory):
    return make_caller_run(tokenizer, tmp_path_factory.mktemp("caller"))


def test_the_training_forward_under_replay_routes_as_the_rollout_did(caller_run, tokenizer, monkeypatch):
    import k3.rl.policy as policy_module
    from k3.rl.losses import loss_config_for
    from k3.rl.policy import PolicyConfig, PolicyUpdater, Sequence
    from k3.rl.routing import RoutingReplay

    _, _, trained = caller_run
    model = copy.deepcopy(trained)
    engine = build_engine(model, tokenizer, 1024, record_routing=True)
    runner = RolloutRunner(engine, tokenizer, RolloutConfig(max_context=1024), seed=3)
    groups = runner.run([task_from_dict(t) for t in say_tasks()], group_size=3, step=1)
    episodes = [e for g in groups for e in g]
    assert max(e.turns for e in episodes) >= 2  # the routing is stitched over turns (tool output in between)
    for e in episodes:
        assert e.routing is not None and e.routing.shape == (3, len(e.ids) - 1, 2)  # all but the last token
    # The update moves the routers before the trainer sees the tokens: left alone they would route otherwise.
    with torch.no_grad():
        for _, router in model.routers():
            router.weight.add_(torch.randn_like(router.weight) * 3)
    seen = []
    original = policy_module.packed_logprobs

    def recording(net, sequences, *args, **kwargs):
        with RoutingReplay(net).record() as routes:
            out = original(net, sequences, *args, **kwargs)
        seen.append((torch.is_grad_enabled(), [len(s) for s in sequences], routes))
        return out

    monkeypatch.setattr(policy_module, "packed_logprobs", recording)

    def routed_as_rollout(with_routing: bool) -> list[bool]:
        seen.clear()
        sequences = [Sequence(e.ids, e.mask, e.logprobs, 1.0 if i % 2 else -1.0, e.routing if with_routing else None)
                     for i, e in enumerate(episodes)]
        updater = PolicyUpdater(model, PolicyConfig(algorithm="grpo", lr=0.0), loss_config_for("grpo"))
        metrics = updater.update(sequences)
        assert metrics["rollout_routed_share"] == (pytest.approx(
            sum(len(e.ids) - 1 for e in episodes) / sum(len(e.ids) for e in episodes)) if with_routing else 0.0)
        training = [(lengths, routes) for grad, lengths, routes in seen if grad]
        assert training
        # one mini-batch: the training forward is the only one (its detached logprobs are the old ones)
        assert all(grad for grad, _, _ in seen)
        same = []
        for lengths, routes in training:
            for layer, calls in enumerate(routes):
                (ids_TK,) = calls
                for episode, rows in zip(episodes, ids_TK.split(lengths)):
                    expected = episode.routing[layer].long()
                    same.append(torch.equal(rows[:-1].sort(-1).values, expected.sort(-1).values))
        return same

    assert all(routed_as_rollout(with_routing=True))
    assert not all(routed_as_rollout(with_routing=False))  # the trainer's own routing: not the rollout's


def rl_config(run, suite, out):
    # 250 tokens a step: two turns, then the groups still running park; they finish (and train) in step 2.
    return RLConfig.flat(run=str(run), suite=str(suite), out=str(out), algo="grpo", group=3, tasks_per_step=2, steps=2,
                         lr=1e-2, heldout_tasks=0, save_every=1, device="cpu", max_context=1024, temperature=1.0,
                         iteration_token_budget=250)


def comparable(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_resume_with_parked_episodes_equals_the_unbroken_run(caller_run, tmp_path, monkeypatch):
    from k3.checkpoint.native import load_checkpoint

    run, suite, _ = caller_run
    quiet = dict(show_progress=False, log=lambda *_: None)
    unbroken = RLTrainer(rl_config(run, suite, tmp_path / "a"), **quiet)
    unbroken.train()
    first = RLTrainer(rl_config(run, suite, tmp_path / "b"), **quiet)
    first.train(stop_at=1)
    saved = load_checkpoint(tmp_path / "b" / "checkpoint.pt")["parked"]
    assert saved["groups"] and saved["snapshots"]  # parked groups, with their sandboxes' layers
    parked = [e for g in saved["groups"] for e in g if not e["done"]]
    assert parked and all(e["parked_snapshot"] in saved["snapshots"] and e["turns"] >= 1 for e in parked)
    # Resume where the layer store never held those snapshots: the checkpoint alone carries them on.
    monkeypatch.setenv("K3_SANDBOX_SCRATCH", str(tmp_path / "other-scratch"))
    resumed = RLTrainer(RLConfig(out=str(tmp_path / "b")), resume=True, **quiet)
    assert resumed.step == 1 and len(resumed.runner.parked) == len(saved["groups"])
    resumed.train()
    a, b = unbroken.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = comparable(tmp_path / "a" / "metrics.jsonl")
    assert records == comparable(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["parked_groups"] > 0 and "loss" in records[1]
    assert all(r.get("rollout_routed_share", 1) > 0 for r in records)
