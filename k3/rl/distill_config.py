"""DistillConfig: a `k3 distill` run, in sections (sampling, loss, optim, heldout). Each field's docstring is its
--help text (k3.cli_config builds the flags); every field keeps the flat name it had when DistillConfig was flat
(--lr, --top-k, --heldout-prompts), so saved distill_config.json files of either layout read back
(DistillConfig.from_dict)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from k3.cli_config import check_positive, from_dict, from_flat, option, replace_flat, section

MODES = ("on-policy", "offline", "forward-kl", "mixed")
ESTIMATORS = ("sampled", "topk")  # on-policy reverse KL: per sampled token (the RL step), or over the teacher's top-k
TOKEN_LEVEL_ALGORITHMS = ("dapo", "cispo", "grpo", "drgrpo")  # objectives with a per-token term
LR_SCHEDULES = ("constant", "cosine")


@dataclass
class DistillSampling:
    """sampling"""

    prompts_per_domain: int = 4
    """prompts of each domain per step"""
    samples: int = 4
    """completions per prompt (G)"""
    prompt_tokens: int = 32
    """text data: the prompt window, in tokens"""
    reference_tokens: int = 32
    """text data: the reference continuation whose loss is the held-out NLL, in tokens"""
    max_new_tokens: int = 32
    """longest completion, in tokens"""
    temperature: float = 1.0
    """sampling temperature (the reverse-KL advantage is exact at 1: the engine's logprobs are at 1)"""
    max_context: int = 1024
    """the engines' longest prompt + completion, in tokens"""

    def __post_init__(self) -> None:
        check_positive(self, "prompts_per_domain", "samples", "max_new_tokens")


@dataclass
class DistillLoss:
    """loss"""

    estimator: str = field(default="sampled", metadata=option(choices=ESTIMATORS))
    """on-policy reverse KL: sampled (default: per-token advantage log p_teacher - log p_student through the
    policy-gradient step) or topk (the reverse KL over the teacher's top-k ids plus one bucket for the rest, at the
    student's own sampled positions)"""
    algo: str = field(default="dapo", metadata=option(choices=TOKEN_LEVEL_ALGORITHMS))
    """policy-gradient objective (default dapo)"""
    top_k: int = 16
    """forward-kl, mixed and the topk estimator: the teacher's top-k ids kept per position"""
    mixed_weight: float = 1.0
    """mixed: weight of the top-k forward KL beside the on-policy term"""
    tis_cap: float | None = 2.0
    """cap of the truncated importance weights between the update's and the sampler's logprobs"""
    baseline: bool = False
    """sampled estimator: subtract the batch's mean advantage (a constant baseline, so unbiased)"""
    clip_low: float | None = None
    """the objective's lower clip (default: the algorithm's published value)"""
    clip_high: float | None = None
    """the objective's upper clip (default: the algorithm's published value)"""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.algo not in TOKEN_LEVEL_ALGORITHMS:
            raise ValueError(f"algo must be a token-level objective {TOKEN_LEVEL_ALGORITHMS} (the reverse-KL "
                             f"advantage is per token), got {self.algo!r}")


@dataclass
class DistillOptim:
    """optimizer"""

    lr: float = 1e-4
    """learning rate"""
    lr_schedule: str = field(default="constant", metadata=option(choices=LR_SCHEDULES))
    """constant (default) or cosine down to lr/10 at the last step"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this"""
    micro_tokens: int = 8192
    """tokens per forward of the update (longer batches are split into micro-batches)"""
    routing_replay: bool = True
    """the update's forward routes each token to the experts that sampled it"""

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be constant or cosine, got {self.lr_schedule!r}")


@dataclass
class DistillHeldout:
    """held-out evaluation"""

    prompts: int = 16
    """held-out prompts per domain"""
    samples: int = 2
    """the student's completions per held-out prompt"""
    every: int = 10
    """steps between held-out evaluations (one is also run at the end)"""

    def __post_init__(self) -> None:
        check_positive(self, "samples", "every", prefix="heldout_")


@dataclass
class DistillConfig:
    """A `k3 distill` run. Sections: sampling (the prompts and completions of a step), loss (the estimator and the
    policy-gradient objective), optim (the update), heldout (the evaluation). Build it nested or by flat names, as
    the flags call the fields: DistillConfig.flat(lr=1e-3, top_k=8). The domain maps (teachers, data, rl_suites)
    take repeatable NAME=... flags of their own (k3.rl.distill_cli)."""

    student: str = ""
    """the student: a k3 run or a Hugging Face-format directory"""
    teachers: dict[str, str] = field(default_factory=dict, metadata=option(cli=False))
    """domain -> its teacher, a k3 run or Hugging Face-format directory (--teacher NAME=DIR)"""
    data: dict[str, str] = field(default_factory=dict, metadata=option(cli=False))
    """domain -> its prompts, see k3.rl.distill_sources (--data NAME=PATH)"""
    rl_suites: dict[str, float] = field(default_factory=dict, metadata=option(cli=False))
    """suite name or task file -> its reward weight (--rl-suite NAME[:WEIGHT])"""
    suite_tasks: int = 512
    """training tasks drawn from each built-in suite"""
    out: str = field(default="runs/distill", metadata=option(show_default=False))
    """the run directory"""
    mode: str = field(default="on-policy", metadata=option(choices=MODES))
    """on-policy (default), offline (SFT on teacher samples), forward-kl (teacher top-k), mixed (on-policy + top-k
    forward KL)"""
    steps: int = 50
    """optimizer steps in all (with --resume: extend the run to this many)"""
    time_budget_s: float | None = None
    """stop cleanly once training has run this long: a held-out evaluation, a save, the steps run reported
    (with --resume: this session's budget)"""
    save_every: int = 10
    """steps between checkpoints (one is also written at the end)"""
    seed: int = 0
    """seed of the prompt draws, sampling and the update"""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N (default auto: cuda if available)"""
    sampling: DistillSampling = section(DistillSampling)
    loss: DistillLoss = section(DistillLoss)
    optim: DistillOptim = section(DistillOptim)
    heldout: DistillHeldout = section(DistillHeldout, prefix="heldout")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_positive(self, "steps", "save_every")
        if self.rl_suites and not self.on_policy:
            raise ValueError(f"--rl-suite adds a task reward to the on-policy advantage; mode {self.mode} has none "
                             f"(use on-policy or mixed)")
        if self.uses_top_k and self.loss.top_k < 1:
            raise ValueError(f"mode {self.mode} (estimator {self.loss.estimator}) needs top_k >= 1, got "
                             f"{self.loss.top_k}")

    @property
    def on_policy(self) -> bool:
        return self.mode in ("on-policy", "mixed")

    @property
    def uses_top_k(self) -> bool:
        return self.mode in ("forward-kl", "mixed") or (self.on_policy and self.loss.estimator == "topk")

    @classmethod
    def flat(cls, **fields: Any) -> DistillConfig:
        """Built from flat names, as the flags call the fields: DistillConfig.flat(lr=1e-3, heldout_prompts=8)."""
        return from_flat(cls, fields)

    def replace(self, **fields: Any) -> DistillConfig:
        """A copy with the fields named by flat name replaced: config.replace(steps=80)."""
        return replace_flat(self, fields)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistillConfig:
        """A saved distill_config.json or checkpoint["distill"]: the sectioned layout, or the flat one of earlier
        runs (a name it does not know is refused by name)."""
        return from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
