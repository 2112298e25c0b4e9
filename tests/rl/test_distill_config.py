"""DistillConfig's sections (sampling, loss, optim, heldout): the flags that build them, the checks each makes, and
runs saved in the earlier flat layout."""

import pytest

from k3.cli import build_parser
from k3.cli_config import flags_of, given, to_flat
from k3.rl.distill import DistillConfig
from k3.rl.distill_config import DistillHeldout, DistillLoss, DistillOptim, DistillSampling

# DistillConfig().to_dict() when every field sat at the top: the layout of runs written before the sections.
FLAT_DEFAULTS = {
    "student": "", "teachers": {}, "data": {}, "out": "runs/distill", "mode": "on-policy", "estimator": "sampled",
    "algo": "dapo", "steps": 50, "time_budget_s": None, "prompts_per_domain": 4, "samples": 4, "prompt_tokens": 32,
    "reference_tokens": 32, "max_new_tokens": 32, "temperature": 1.0, "lr": 1e-4, "lr_schedule": "constant",
    "weight_decay": 0.0, "grad_clip": 1.0, "top_k": 16, "mixed_weight": 1.0, "rl_suites": {}, "suite_tasks": 512,
    "tis_cap": 2.0, "baseline": False, "clip_low": None, "clip_high": None, "heldout_prompts": 16,
    "heldout_samples": 2, "heldout_every": 10, "save_every": 10, "seed": 0, "max_context": 1024,
    "micro_tokens": 8192, "routing_replay": True, "device": "auto"}


def distill_config(*argv: str) -> DistillConfig:
    args = build_parser().parse_args(["distill", *argv])
    return DistillConfig.flat(**given(DistillConfig, args))


def test_every_earlier_field_keeps_its_flat_name_and_default() -> None:
    assert to_flat(DistillConfig()) == FLAT_DEFAULTS


def test_the_flat_layout_reads_back() -> None:
    assert DistillConfig.from_dict(FLAT_DEFAULTS) == DistillConfig()
    old = {**FLAT_DEFAULTS, "lr": 1e-3, "top_k": 8, "max_context": 512, "heldout_samples": 3, "mode": "mixed"}
    config = DistillConfig.from_dict(old)
    assert (config.optim.lr, config.loss.top_k, config.sampling.max_context, config.heldout.samples,
            config.mode) == (1e-3, 8, 512, 3, "mixed")
    assert DistillConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="no field 'bogus'"):
        DistillConfig.from_dict({**FLAT_DEFAULTS, "bogus": 1})


def test_flags_build_the_sections() -> None:
    config = distill_config("--student", "s", "--lr", "1e-3", "--lr-schedule", "cosine", "--top-k", "8",
                            "--estimator", "topk", "--mode", "mixed", "--samples", "3", "--heldout-samples", "5",
                            "--heldout-every", "4", "--max-context", "256", "--no-routing-replay", "--steps", "7")
    assert config.optim == DistillOptim(lr=1e-3, lr_schedule="cosine", routing_replay=False)
    assert config.loss == DistillLoss(estimator="topk", top_k=8)
    assert config.sampling == DistillSampling(samples=3, max_context=256)
    assert config.heldout == DistillHeldout(samples=5, every=4)
    assert (config.student, config.mode, config.steps) == ("s", "mixed", 7)
    assert distill_config() == DistillConfig()  # a flag left out keeps its default


def test_the_fields_of_the_sections_have_their_flags() -> None:
    flags = flags_of(DistillConfig)
    assert {"--weight-decay", "--grad-clip", "--micro-tokens", "--no-routing-replay",
            "--clip-low", "--clip-high"} <= flags
    assert not {"--teachers", "--data", "--rl-suites"} & flags  # the domain maps take NAME=... flags of their own


def test_each_section_checks_its_fields_and_the_config_those_across_them() -> None:
    with pytest.raises(ValueError, match="heldout_samples must be at least 1"):
        DistillConfig.flat(heldout_samples=0)
    with pytest.raises(ValueError, match="samples must be at least 1"):
        DistillConfig.flat(samples=0)
    with pytest.raises(ValueError, match="algo must be a token-level objective"):
        DistillConfig.flat(algo="gspo")
    with pytest.raises(ValueError, match="lr_schedule must be constant or cosine"):
        DistillConfig.flat(lr_schedule="linear")
    with pytest.raises(ValueError, match="needs top_k >= 1"):
        DistillConfig.flat(mode="forward-kl", top_k=0)
    with pytest.raises(ValueError, match="--rl-suite adds a task reward"):
        DistillConfig.flat(mode="offline", rl_suites={"calc": 1.0})
    assert DistillConfig.flat(mode="offline", top_k=0).loss.top_k == 0  # offline uses no top-k


def test_replace_keeps_the_rest() -> None:
    config = DistillConfig.flat(lr=1e-3, heldout_prompts=8)
    longer = config.replace(steps=80)
    assert (longer.steps, longer.optim.lr, longer.heldout.prompts) == (80, 1e-3, 8)
