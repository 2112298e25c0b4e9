"""RLConfig: a `k3 rl` run, nesting the configs the loop hands down (PolicyConfig to the updater, LossConfig to the
loss, RolloutConfig to the rollouts). Each field's docstring is its --help text (k3.cli_config builds the flags);
every field keeps the flat name it had when RLConfig was flat (--lr, --clip-high, --max-context), so saved
rl_config.json files of either layout read back (RLConfig.from_dict)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from k3.cli_config import check_positive, from_dict, from_flat, option, replace_flat, section
from k3.rl.losses import ALGORITHMS, LossConfig, loss_config_for
from k3.rl.policy import PolicyConfig
from k3.rl.rollout import RolloutConfig
from k3.runtime import DTYPE_CHOICES

# Refill draws come from indices far from every step's first draw (which starts at 0).
REFILL_START, MAX_REFILL_ROUNDS = 1 << 30, 16
SANDBOX_BACKENDS = ("local", "vm")
ROUTING_SOURCES = ("rollout", "trainer")
# The loss fields whose None means "the algorithm's published default" (loss_config_for).
ALGORITHM_DEFAULTS = ("clip_low", "clip_high", "tau")


@dataclass
class RLConfig:
    """A `k3 rl` run. Nested: policy (PolicyConfig: the optimizer and the update), loss (LossConfig: clip_low,
    clip_high and tau left None take the algorithm's published values at construction), rollout (RolloutConfig).
    policy.algorithm / policy.temperature, loss.norm_length and rollout.max_live_episodes follow from the other
    fields. Build it nested or by flat names, as the flags call the fields: RLConfig.flat(lr=1e-5, clip_high=0.3)."""

    run: str = field(default="", metadata=option(aliases=("--from",), help=(
        "starting checkpoint: a k3 train / k3 sft / k3 rl run directory (--from: the same, for torchrun, whose own "
        "--run-path makes it refuse --run)")))
    suite: str = "calc"
    """calc, arith, fix, files, browse, or a .jsonl file / directory of tasks"""
    out: str = field(default="runs/rl", metadata=option(show_default=False))
    """the RL run directory (demos: the JSONL file to write)"""
    algo: str = field(default="gspo", metadata=option(choices=sorted(ALGORITHMS)))
    """policy objective"""
    group: int = 8
    """episodes per task, forked from one snapshot"""
    tasks_per_step: int = 4
    """tasks drawn per step"""
    steps: int = 20
    """steps in all (with --resume: extend the run to this many)"""
    time_budget_s: float | None = None
    """stop cleanly once training has run this long: a held-out evaluation, a save, the steps run reported
    (with --resume: this session's budget)"""
    eval_temperature: float = field(default=0.0, metadata=option(cli=False))
    """held-out evaluation's sampling temperature (0: greedy)"""
    heldout_samples: int | None = None
    """held-out episodes per task at the rollout temperature, for sampled pass@1 and pass@k (default: the group size;
    0: greedy only)"""
    heldout_every: int = 10
    """steps between held-out evaluations"""
    heldout_tasks: int = 50
    """held-out tasks scored at each evaluation"""
    save_every: int = 10
    """steps between checkpoints"""
    seed: int = 0
    """seed of the task draws, sampling and the update"""
    dynamic_sampling: bool | None = field(default=None, metadata=option(cli=False))
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (None: on for dapo only)"""
    refill_rounds: int = 3
    """dynamic sampling: extra rounds of fresh tasks that refill a batch whose all-equal groups were dropped
    (default 3; 0: no refill)"""
    routing_source: str = field(default="rollout", metadata=option(choices=ROUTING_SOURCES))
    """routing replay of the engine's recorded experts (default) or of the trainer's old pass"""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N"""
    cuda_graphs: bool | None = field(default=None, metadata=option(cli=False))
    """the engine's CUDA-graph decode (None: the engine decides)"""
    rollout_dtype: str = field(default="auto", metadata=option(choices=DTYPE_CHOICES))
    """the in-process engine's weights: auto = a bf16 copy of the policy on CUDA, refreshed after each update (fp32:
    the policy itself, the default on CPU)"""
    ray: str | None = field(default=None, metadata=option(metavar="ADDRESS", const="local"))
    """rollouts on Ray workers: a local Ray (no ADDRESS) or the cluster at ADDRESS"""
    rollout_workers: int = 2
    """--ray: rollout workers, each with a policy copy, an engine and its sandboxes"""
    rollout_worker_cpus: float = 1.0
    """--ray: CPUs of a rollout worker"""
    rollout_worker_gpus: float = 0.0
    """--ray: GPUs of a rollout worker"""
    rollout_timeout_s: float | None = field(default=None, metadata=option(cli=False))
    """--ray: longest wait for the workers' answer to one call"""
    policy: PolicyConfig = section(PolicyConfig, title="policy update", derived=("algorithm", "temperature"),
                                   no_flag=("weight_decay", "grad_clip", "micro_tokens", "update_balancer",
                                            "pack_multiple"))
    loss: LossConfig = section(LossConfig, title="loss", derived=("norm_length",),
                               default=lambda: LossConfig(**{name: None for name in ALGORITHM_DEFAULTS}))
    rollout: RolloutConfig = section(RolloutConfig, title="rollouts", derived=("max_live_episodes",),
                                     no_flag=("top_p", "tool_timeout", "threads", "keep_transcripts"),
                                     default=lambda: RolloutConfig(max_context=2048, tool_budget=1000))

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {sorted(ALGORITHMS)}, got {self.algo!r}")
        check_positive(self, "group", "tasks_per_step", "steps", "heldout_every", "save_every")
        check_positive(self.policy, "minibatches")
        if self.routing_source not in ROUTING_SOURCES:
            raise ValueError(f"routing_source must be 'rollout' or 'trainer', got {self.routing_source!r}")
        if self.cuda_graphs and self.policy.routing_replay and self.routing_source == "rollout":
            raise ValueError("cuda_graphs=True cannot record the rollout's routing (the engine records in eager steps "
                             "only): use routing_source='trainer' with CUDA graphs, or leave cuda_graphs unset")
        if self.heldout_samples is not None and self.heldout_samples < 0:
            raise ValueError(f"heldout_samples must be >= 0 (0: greedy only), got {self.heldout_samples}")
        if self.heldout_tasks < 0:
            raise ValueError(f"heldout_tasks must be >= 0, got {self.heldout_tasks}")
        if not 0 <= self.refill_rounds <= MAX_REFILL_ROUNDS:
            raise ValueError(f"refill_rounds must be in [0, {MAX_REFILL_ROUNDS}], got {self.refill_rounds}")
        rollout = self.rollout
        if rollout.sandbox_backend not in SANDBOX_BACKENDS:
            raise ValueError(f"sandbox_backend must be 'local' or 'vm', got {rollout.sandbox_backend!r}")
        if rollout.sandbox_backend == "vm" and (self.ray or rollout.iteration_token_budget):
            raise ValueError("sandbox_backend='vm' runs rollouts in this process without parking (no --ray, no "
                             "--iteration-token-budget): parked and exported snapshots are the local backend's")
        if self.rollout_dtype not in DTYPE_CHOICES:
            raise ValueError(f"rollout_dtype must be one of {DTYPE_CHOICES}, got {self.rollout_dtype!r}")
        # What follows from the rest. The update scores the rollout's samples at its temperature (0, greedy, is
        # scored as 1); the loss's None fields take the algorithm's values; a batch runs all its episodes at once.
        self.policy = dataclasses.replace(self.policy, algorithm=self.algo, temperature=rollout.temperature or 1.0)
        published = loss_config_for(self.algo)
        self.loss = dataclasses.replace(self.loss, norm_length=rollout.max_context, **{
            name: getattr(published, name) for name in ALGORITHM_DEFAULTS if getattr(self.loss, name) is None})
        self.rollout = dataclasses.replace(rollout, max_live_episodes=min(256, self.group * self.tasks_per_step))

    @classmethod
    def flat(cls, **fields: Any) -> RLConfig:
        """Built from flat names, as the flags call the fields: RLConfig.flat(lr=1e-5, max_context=1024)."""
        return from_flat(cls, fields)

    def replace(self, **fields: Any) -> RLConfig:
        """A copy with the fields named by flat name replaced: config.replace(steps=40)."""
        return replace_flat(self, fields)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RLConfig:
        """A saved rl_config.json or checkpoint["rl"]: the nested layout, or the flat one of earlier runs."""
        return from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
