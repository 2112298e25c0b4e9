"""RLConfig nests the policy, loss and rollout configs: the flags that build it, what follows from its fields, and
runs saved in the earlier flat layout."""

import pytest

from k3.cli import build_parser
from k3.cli_config import given, to_flat
from k3.rl.config import RLConfig
from k3.rl.losses import LossConfig, loss_config_for

# RLConfig().to_dict() when every field sat at the top: the layout of runs written before the nesting.
FLAT_DEFAULTS = {
    "run": "", "suite": "calc", "out": "runs/rl", "algo": "gspo", "group": 8, "tasks_per_step": 4, "steps": 20,
    "lr": 1e-05, "minibatches": 1, "temperature": 1.0, "eval_temperature": 0.0, "heldout_samples": None,
    "heldout_every": 10, "heldout_tasks": 50, "save_every": 10, "seed": 0, "kl_coef": 0.0, "tis_cap": 2.0,
    "clip_low": None, "clip_high": None, "tau": None, "dynamic_sampling": None, "refill_rounds": 3,
    "routing_replay": True, "routing_source": "rollout", "update_balancer": False, "max_context": 2048,
    "tool_budget": 1000, "iteration_token_budget": None, "micro_tokens": 8192, "device": "auto", "threads": 8,
    "cuda_graphs": None, "rollout_dtype": "auto", "ray": None, "rollout_workers": 2, "rollout_worker_cpus": 1.0,
    "rollout_worker_gpus": 0.0, "rollout_timeout_s": None, "sandbox_backend": "local"}
PUBLISHED = ("clip_low", "clip_high", "tau")  # None then: the algorithm's value, filled in at construction


def rl_config(*argv: str) -> RLConfig:
    args = build_parser().parse_args(["rl", *argv])
    fields = given(RLConfig, args)
    if args.no_tis:
        fields["tis_cap"] = None
    return RLConfig.flat(**fields)


def test_every_earlier_field_keeps_its_name_and_default() -> None:
    now = to_flat(RLConfig())
    assert {k: v for k, v in now.items() if k in FLAT_DEFAULTS and k not in PUBLISHED} == {
        k: v for k, v in FLAT_DEFAULTS.items() if k not in PUBLISHED}
    gspo = loss_config_for("gspo")
    assert [now[k] for k in PUBLISHED] == [gspo.clip_low, gspo.clip_high, gspo.tau]


def test_the_flat_layout_reads_back() -> None:
    assert RLConfig.from_dict(FLAT_DEFAULTS) == RLConfig()
    old = {**FLAT_DEFAULTS, "algo": "dapo", "lr": 1e-3, "clip_high": 0.3, "max_context": 512, "threads": 2}
    config = RLConfig.from_dict(old)
    assert (config.policy.lr, config.loss.clip_high, config.loss.clip_low, config.rollout.max_context,
            config.rollout.threads) == (1e-3, 0.3, 0.2, 512, 2)
    assert RLConfig.from_dict(config.to_dict()) == config


def test_what_follows_from_the_other_fields() -> None:
    config = RLConfig.flat(algo="drgrpo", temperature=0.0, max_context=300, group=3, tasks_per_step=5)
    assert (config.policy.algorithm, config.policy.temperature) == ("drgrpo", 1.0)  # greedy is scored as T=1
    assert config.loss == LossConfig(clip_low=0.2, clip_high=0.2, tau=0.1, norm_length=300, tis_cap=2.0)
    assert config.rollout.max_live_episodes == 15
    assert config.replace(steps=40).loss == config.loss  # resolved once, kept through a replace


def test_flags_build_the_nested_configs() -> None:
    config = rl_config("--run", "r", "--algo", "dapo", "--clip-high", "0.3", "--lr", "1e-4", "--no-routing-replay",
                       "--no-tis", "--max-context", "512", "--temperature", "0.7", "--sandbox-backend", "local",
                       "--threads", "3", "--ray")
    assert config.loss.clip_high == 0.3 and config.loss.clip_low == 0.2 and config.loss.tis_cap is None
    assert config.policy.lr == 1e-4 and config.policy.routing_replay is False and config.policy.temperature == 0.7
    assert config.rollout.max_context == 512 and config.rollout.threads == 8  # --threads is torch's, not rollout's
    assert config.ray == "local" and rl_config("--ray", "host:6379").ray == "host:6379"


def test_a_check_across_sections_still_holds() -> None:
    with pytest.raises(ValueError, match="cuda_graphs=True cannot record the rollout's routing"):
        RLConfig.flat(cuda_graphs=True)
    with pytest.raises(ValueError, match="sandbox_backend='vm' runs rollouts in this process"):
        RLConfig.flat(sandbox_backend="vm", iteration_token_budget=10)
    with pytest.raises(ValueError, match="minibatches must be at least 1"):
        RLConfig.flat(minibatches=0)
