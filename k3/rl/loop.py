"""The RL loop: a k3 checkpoint plus a task suite in, a better checkpoint out.

Per step: draw ``tasks_per_step`` training tasks, run ``group`` episodes of each (one snapshot forked per
task, all episodes batched through the engine), score them, turn rewards into group advantages, update the
policy (k3.rl.policy), and the engine - which holds the same model object, in process - samples from the new
weights at the next step. Every ``heldout_every`` steps the held-out split is scored (greedy by default).

Run directory (as `k3 train` writes one, so `k3 generate --run` and `k3 rl --run` read it):
    rl_config.json   the RLConfig
    config.json      the ModelConfig
    tokenizer/       the tokenizer files
    checkpoint.pt    model, optimizer, step, RNG states (atomic; see k3.checkpoint.native)
    metrics.jsonl    one record per step; metrics.png the curves

Resume is exact: tasks and sampling seeds follow from (seed, step), and the RNG states are saved, so a run
stopped and resumed equals the unbroken run. Episodes parked by partial rollouts are saved with the
checkpoint (their tokens, counters and routing, and each parked sandbox's snapshot exported from the layer
store), so a resumed run continues them as the unbroken run does.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, Callable

import torch

from k3.checkpoint.inference import load_trainable
from k3.rl.config import MAX_REFILL_ROUNDS, REFILL_START, RLConfig  # noqa: F401 (RLConfig: k3.rl.loop's API)
from k3.rl.losses import ALGORITHMS, dynamic_sampling_keep, group_advantages
from k3.rl.policy import PolicyUpdater, Sequence
from k3.rl.rollout import Episode, RolloutRunner
from k3.rl.rollout_engine import build_engine, rollout_copy, sync_rollout_copy, weights_changed
from k3.rl.tasks import Task, load_tasks
from k3.runtime import autocast_dtype, resolve_device, seed_everything
from k3.train.loop import Cadence, LoopHooks, TrainingLoop
from k3.train.metrics import figure_grid, metric_series, read_metrics, save_figure
from k3.train.run_dir import RunKind, open_run

RUN = RunKind(key="rl", settings_file="rl_config.json", command="k3 rl", what="an RL run")


class TaskSource:
    """The training and held-out tasks of a suite: a built-in generator or a loaded task file."""

    def __init__(self, suite: str, seed: int) -> None:
        from k3.rl.suites import SUITE_NAMES, get_suite

        self.seed = seed
        if suite in SUITE_NAMES:
            self.builtin = get_suite(suite)
            self.train_tasks = self.heldout_pool = None
        else:
            self.builtin = None
            tasks = load_tasks(suite)
            self.train_tasks = [t for t in tasks if t.split == "train"]
            self.heldout_pool = [t for t in tasks if t.split == "heldout"]
            if not self.train_tasks:
                raise ValueError(f"{suite} holds no tasks with split 'train' to learn from")

    def train(self, step: int, count: int) -> list[Task]:
        """The tasks of step ``step`` (1-based): fixed by (seed, step), so a resumed run draws the same."""
        if self.builtin is not None:
            start = (self.seed * 1_000_003 + (step - 1) * count) % (2 ** 31)
            return self.builtin.tasks("train", count, start=start)
        rng = random.Random(f"{self.seed}/{step}")
        return [rng.choice(self.train_tasks) for _ in range(count)]

    def refill(self, step: int, round_: int, count: int, stride: int) -> list[Task]:
        """Fresh training tasks for dynamic sampling's refill round ``round_`` (1-based) of step ``step``: fixed by
        (seed, step, round), apart from every step's first draw (train) and from every other refill."""
        if self.builtin is not None:
            start = (self.seed * 1_000_003 + REFILL_START + ((step - 1) * MAX_REFILL_ROUNDS + round_ - 1) * stride)
            return self.builtin.tasks("train", count, start=start % (2 ** 31))
        rng = random.Random(f"{self.seed}/{step}/refill {round_}")
        return [rng.choice(self.train_tasks) for _ in range(count)]

    def heldout(self, count: int) -> list[Task]:
        """The first ``count`` held-out tasks; a built-in suite's with distinct prompts (its generator repeats
        some, e.g. calc's common words, which would weigh a few prompts many times in the pass rate)."""
        if self.builtin is None:
            return self.heldout_pool[:count]
        tasks, seen, index = [], set(), 0
        while len(tasks) < count and index < 20 * count + 1000:
            task = self.builtin.task("heldout", index)
            index += 1
            if task.prompt not in seen:
                seen.add(task.prompt)
                tasks.append(task)
        return tasks


def episode_summary(e: Episode) -> dict[str, Any]:
    """What the step's metrics need of an episode (small: gathered from every rank under torchrun)."""
    return {"task": e.task.id, "reward": e.reward, "model_tokens": e.model_tokens, "tokens": len(e.ids),
            "turns": e.turns, "tool_calls": e.tool_calls, "tool_errors": e.tool_errors, "sandbox_calls": e.sandbox_calls,
            "failed": e.failed, "sandbox_seconds": e.sandbox_seconds, "finish": e.finish}


def _episode_metrics(episodes: list[dict[str, Any]]) -> dict[str, float]:
    """Step metrics from episode_summary records."""
    n = max(len(episodes), 1)
    finishes: dict[str, int] = {}
    for e in episodes:
        finishes[e["finish"]] = finishes.get(e["finish"], 0) + 1
    return {
        "reward_mean": sum(e["reward"] for e in episodes) / n,
        "pass_rate": sum(e["reward"] >= 1.0 for e in episodes) / n,
        "response_tokens": sum(e["model_tokens"] for e in episodes) / n,
        "episode_tokens": sum(e["tokens"] for e in episodes) / n,
        "turns": sum(e["turns"] for e in episodes) / n,
        "tool_calls": sum(e["tool_calls"] for e in episodes) / n,
        "tool_errors": sum(e["tool_errors"] for e in episodes) / n,
        "sandbox_calls": sum(e["sandbox_calls"] for e in episodes),
        "sandbox_failures": sum(e["failed"] for e in episodes),
        "sandbox_s": sum(e["sandbox_seconds"] for e in episodes),
        "episodes": len(episodes),
        "finish": finishes,
    }


class RLTrainer:
    def __init__(self, config: RLConfig, resume: bool = False, log: Callable[[str], None] = print,
                 show_progress: bool = True, model=None, tokenizer=None,
                 resume_overrides: dict[str, Any] | None = None) -> None:
        """resume: continue DIR/checkpoint.pt exactly (only ``config.out`` is read from ``config``, and
        ``resume_overrides``, the fields the command line replaces: {"steps": 40} extends the run). model and
        tokenizer: start from these (Python use) instead of loading ``config.run``."""
        self.log, self.show_progress = log, show_progress
        # The saved settings: nested, or the flat layout of earlier runs.
        opened = open_run(RUN, config, resume, RLConfig.from_dict, **(resume_overrides or {}))
        self.run_dir, state, self.config = opened.directory, opened.state, opened.config
        config, self.out = self.config, self.run_dir.out
        from k3.rl.data_parallel import Ranks

        self.ranks = Ranks(config.device)  # torchrun: join the job (data-parallel RL, k3.rl.data_parallel)
        if self.ranks.world > 1 and config.ray:
            raise ValueError("--ray rollouts and torchrun training do not combine yet: run one process with --ray "
                             "or torchrun without it")
        self.device = self.ranks.device or resolve_device(config.device)
        if not self.ranks.main:
            self.log, self.show_progress = (lambda *_: None), False
        self.autocast = autocast_dtype("auto", self.device)
        seed_everything(config.seed)
        self.model, self.tokenizer = opened.policy(
            self.device, model, tokenizer, source=config.run, load=load_trainable,
            needs="give the starting checkpoint: --run DIR (a `k3 train`, `k3 sft` or `k3 rl` run)")
        self.model_config = self.model.config
        self.reference = None
        if config.loss.kl_coef > 0:
            import copy

            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.updater = PolicyUpdater(self.model, config.policy, config.loss, reference=self.reference,
                                     autocast=self.autocast)
        record_routing = config.policy.routing_replay and config.routing_source == "rollout"
        rollout = config.rollout
        max_batch = rollout.max_live_episodes  # a step's episodes all run at once
        if rollout.sandbox_backend == "vm":  # fail now, saying why, rather than fail every episode's sandbox
            from k3.sandbox.vm.config import VmConfig, require_kvm

            require_kvm(VmConfig.from_env())
        self._started_ray = False
        self.rollout_model = self.model
        if config.ray:
            from k3.rl.fleet import RayRollouts

            self._join_ray(config.ray)
            self.engine = None
            self.runner = RayRollouts(self.model, self.tokenizer, rollout, workers=config.rollout_workers,
                                      seed=config.seed, max_batch=max_batch, record_routing=record_routing,
                                      num_cpus=config.rollout_worker_cpus, num_gpus=config.rollout_worker_gpus,
                                      cuda_graphs=config.cuda_graphs, timeout=config.rollout_timeout_s,
                                      dtype=config.rollout_dtype)
        else:
            self.rollout_model = rollout_copy(self.model, config.rollout_dtype)
            self.engine = build_engine(self.rollout_model, self.tokenizer, rollout.max_context, max_batch=max_batch,
                                       cuda_graphs=config.cuda_graphs, record_routing=record_routing)
            self.runner = RolloutRunner(self.engine, self.tokenizer, rollout, seed=config.seed)
        if state is not None:
            from k3.rl.data_parallel import parked_share

            self.runner.restore_parked(parked_share(state.get("parked"), self.ranks.rank, self.ranks.world))
        self.tasks = TaskSource(config.suite, config.seed)
        if self.ranks.main or state is not None:  # a new run's files are rank 0's to write
            self.step = self.run_dir.start_or_restore(state, self.updater.optimizer, self.tokenizer,
                                                      config.to_dict(), self.model_config.to_dict())
        else:
            self.step = 0
        self.metrics = self.run_dir.metrics(self.step, resumed=state is not None) if self.ranks.main else None
        self.ranks.barrier()

    def _join_ray(self, address: str) -> None:
        import ray

        if ray.is_initialized():
            return
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self._started_ray = True

    def close(self) -> None:
        """Stop the Ray rollout workers (and the Ray this trainer started), or leave the torchrun job."""
        self.ranks.shutdown()
        if self.config.ray and self.runner.workers:
            self.runner.close()
            if self._started_ray:
                import ray

                ray.shutdown()
                self._started_ray = False

    def _weights_changed(self) -> None:
        if self.engine is None:
            self.runner.push_weights(self.model)  # Ray workers: the new weights to every engine copy
        else:
            if self.rollout_model is not self.model:
                sync_rollout_copy(self.rollout_model, self.model)
            weights_changed(self.engine)

    # -- pieces ------------------------------------------------------------------------------------
    def evaluate(self, count: int | None = None, temperature: float | None = None,
                 outcomes: bool = False, samples: int = 1, split: str = "heldout") -> dict[str, Any]:
        """Pass rate on the first ``count`` held-out tasks, ``samples`` episodes each (greedy unless told; with
        several samples at a temperature the rate is the mean over all episodes, a lower-variance estimate of the
        one-sample rate, and "heldout_pass_at_k" the share of tasks some sample solved). outcomes: also
        "heldout_outcomes", {task id: passed} for one sample, {task id: share of its samples that passed} for
        several (for a paired before/after comparison on the same tasks). split="train": the first ``count``
        tasks of RL's own training stream instead (the keys keep their names)."""
        if samples < 1:
            raise ValueError(f"samples must be at least 1, got {samples}")
        count = self.config.heldout_tasks if count is None else count
        chosen = self.tasks.heldout(count) if split == "heldout" else self.tasks.train(1, count)
        tasks, indices = self.ranks.share(chosen)
        if not tasks and self.ranks.world == 1:
            return {}
        groups = self.runner.run_aside(tasks, samples, -1, self.config.eval_temperature if temperature is None
                                       else temperature, indices)
        episodes = [s for rank in self.ranks.gather([episode_summary(e) for g in groups for e in g]) for s in rank]
        if not episodes:
            return {}
        stats = _episode_metrics(episodes)
        passed: dict[str, list[bool]] = {}
        for e in episodes:
            passed.setdefault(e["task"], []).append(e["reward"] >= 1.0)
        result = {"heldout_pass_rate": stats["pass_rate"], "heldout_reward": stats["reward_mean"],
                  "heldout_tasks": len(passed), "heldout_episodes": len(episodes),
                  "heldout_sandbox_calls": stats["sandbox_calls"]}
        if samples > 1:  # pass@k, k = samples: the share of tasks some sample solved
            result["heldout_pass_at_k"] = sum(any(runs) for runs in passed.values()) / len(passed)
        if outcomes:
            result["heldout_outcomes"] = {task: (runs[0] if samples == 1 else sum(runs) / len(runs))
                                          for task, runs in passed.items()}
        return result

    def evaluate_headroom(self, count: int | None = None, outcomes: bool = False,
                          sampled_count: int | None = None) -> dict[str, Any]:
        """The held-out scores that say how much RL can find: greedy pass@1 (``heldout_pass_rate``), and at the
        rollout temperature with ``heldout_samples`` episodes a task (default: the group size, the k of RL's
        groups) the sampled pass@1 (``heldout_sampled_pass_rate``, their mean) and ``heldout_pass_at_k``; and
        ``heldout_headroom`` = pass@k - max(greedy, sampled pass@1), what picking among the policy's own samples
        can add (RL raises pass@1 towards the starting policy's pass@k, not beyond: Yue et al. 2025).
        sampled_count: score the sampled rates on the first this many of the tasks only (default: all)."""
        greedy = self.evaluate(count, outcomes=outcomes)
        k = self.config.group if self.config.heldout_samples is None else self.config.heldout_samples
        if not greedy or k < 1:
            return greedy
        sampled = self.evaluate(count if sampled_count is None else sampled_count,
                                temperature=self.config.rollout.temperature, outcomes=outcomes, samples=k)
        result = {**greedy, "heldout_sampled_pass_rate": sampled["heldout_pass_rate"], "heldout_samples": k,
                  "heldout_sampled_tasks": sampled["heldout_tasks"],
                  "heldout_sandbox_calls": greedy["heldout_sandbox_calls"] + sampled["heldout_sandbox_calls"]}
        if outcomes:
            result["heldout_sampled_outcomes"] = sampled["heldout_outcomes"]
        if "heldout_pass_at_k" in sampled:
            result["heldout_pass_at_k"] = sampled["heldout_pass_at_k"]
            result["heldout_headroom"] = sampled["heldout_pass_at_k"] - max(greedy["heldout_pass_rate"],
                                                                           sampled["heldout_pass_rate"])
        return result

    def sequences(self, groups: list[list[Episode]]) -> tuple[list[Sequence], int]:
        """Group advantages -> trainable sequences; (sequences, groups kept)."""
        algorithm = ALGORITHMS[self.config.algo]
        rewards = [[e.reward for e in g] for g in groups]
        keep = dynamic_sampling_keep(rewards) if self._dynamic_sampling() else [True] * len(groups)
        out = []
        for group, group_rewards, kept in zip(groups, rewards, keep):
            if not kept:
                continue
            advantages = group_advantages(torch.tensor(group_rewards, dtype=torch.float32), algorithm.advantage)
            for episode, advantage in zip(group, advantages.tolist()):
                if episode.failed or not any(episode.mask):
                    continue  # a sandbox failure is not the policy's doing: no gradient from it
                out.append(Sequence(episode.ids, episode.mask, episode.logprobs, advantage, episode.routing))
        return out, sum(keep)

    def _dynamic_sampling(self) -> bool:
        return self.config.dynamic_sampling if self.config.dynamic_sampling is not None else self.config.algo == "dapo"

    def _refill(self, groups: list[list[Episode]], stats: dict) -> tuple[list[list[Episode]], dict]:
        """DAPO's dynamic sampling keeps the batch full: while fewer than tasks_per_step groups (over every rank)
        have unequal rewards, roll out fresh tasks, in at most refill_rounds extra rounds, each drawing the
        missing groups scaled by the share kept so far. Refill rounds run beside the parked partial rollouts
        (run_aside) and add their timings to ``stats``; in one process the last round's surplus is dropped, so
        the batch holds exactly tasks_per_step kept groups when it filled. Returns (groups, refill metrics)."""
        config = self.config
        want = config.tasks_per_step
        kept_here = sum(dynamic_sampling_keep([[e.reward for e in g] for g in groups]))
        kept, drawn = sum(self.ranks.gather(kept_here)), sum(self.ranks.gather(len(groups)))
        rounds = refilled = 0
        while kept < want and rounds < config.refill_rounds:
            rounds += 1
            count = min(want, math.ceil((want - kept) * drawn / max(kept, 1)))
            tasks, indices = self.ranks.share(self.tasks.refill(self.step, rounds, count, stride=want))
            # Its own sampling seeds (they follow from the step argument): a task drawn again samples afresh.
            more = self.runner.run_aside(tasks, config.group, f"{self.step}/refill {rounds}",
                                         config.rollout.temperature, indices)
            for key, value in self.runner.stats.items():
                if isinstance(value, (int, float)) and key != "rollout_tokens_per_s":
                    stats[key] = stats.get(key, 0) + value
            kept_more = dynamic_sampling_keep([[e.reward for e in g] for g in more])
            if self.ranks.world == 1 and kept + sum(kept_more) > want:  # drop the surplus kept groups
                surplus = kept + sum(kept_more) - want
                for index in reversed(range(len(more))):
                    if surplus and kept_more[index]:
                        del more[index]
                        surplus -= 1
            groups = groups + more
            refilled += len(more)
            kept = sum(self.ranks.gather(sum(dynamic_sampling_keep([[e.reward for e in g] for g in groups]))))
            drawn += count
        if stats.get("generation_s"):
            stats["rollout_tokens_per_s"] = stats["generated_tokens"] / stats["generation_s"]
        return groups, {"refill_rounds": rounds, "refill_groups": sum(self.ranks.gather(refilled))}

    def save(self) -> None:
        """The checkpoint, with every rank's parked groups (collective under torchrun; rank 0 writes)."""
        from k3.rl.data_parallel import merge_parked

        parked = merge_parked(self.ranks.gather(self.runner.parked_state()))
        if self.ranks.main:
            self.run_dir.save(self.model.state_dict(), self.updater.optimizer.state_dict(),
                              self.model_config.to_dict(), self.config.to_dict(), self.step, extra={"parked": parked})

    def plot(self) -> None:
        if self.ranks.main:
            plot_rl_metrics(self.out / "metrics.jsonl", self.out / "metrics.png")

    def train_step(self) -> dict[str, Any]:
        self.step += 1
        started = time.perf_counter()
        tasks, indices = self.ranks.share(self.tasks.train(self.step, self.config.tasks_per_step))
        groups = self.runner.run(tasks, self.config.group, self.step, indices)
        stats = dict(self.runner.stats)
        refill = {}
        if self._dynamic_sampling() and self.config.refill_rounds:
            groups, refill = self._refill(groups, stats)
        self.last_groups = groups
        gathered = self.ranks.gather(({"stats": stats, "groups": len(groups),
                                       "episodes": [episode_summary(e) for g in groups for e in g]}))
        if self.ranks.world > 1:
            from k3.rl.fleet import merge_stats

            rollout_stats = merge_stats([g["stats"] for g in gathered])
        else:
            rollout_stats = gathered[0]["stats"]
        episodes = [e for g in gathered for e in g["episodes"]]
        t0 = time.perf_counter()
        sequences, kept = self.sequences(groups)
        kept = sum(self.ranks.gather(kept))
        learn = self.ranks.any(any(s.advantage != 0 for s in sequences))  # every rank updates, or none
        update = self.updater.update(sequences) if learn else {}
        if update:
            self._weights_changed()
        train_s = time.perf_counter() - t0
        record = {"step": self.step, **_episode_metrics(episodes), **update, "groups_kept": kept, **refill,
                  "groups": sum(g["groups"] for g in gathered), **{k: round(v, 4) if isinstance(v, float) else v
                                                                  for k, v in rollout_stats.items()},
                  "train_s": train_s, "step_s": time.perf_counter() - started}
        if not update:
            record["skipped_update"] = "every advantage was 0 (all rewards in each group equal)"
        return record

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Run to ``steps`` (or stop after step ``stop_at``, as an interrupted run would)."""
        config = self.config
        loop = TrainingLoop(
            Cadence(config.steps, config.save_every, eval_every=config.heldout_every),
            LoopHooks(step=self.train_step, position=lambda: self.step, save=self.save,
                      evaluate=self.evaluate_headroom if config.heldout_tasks else None, plot=self.plot,
                      describe_first_eval=headroom_lines,
                      progress=lambda r: {"reward": f"{r['reward_mean']:.3f}", "pass_rate": f"{r['pass_rate']:.2f}"}),
            metrics=self.metrics, desc="rl", show_progress=self.show_progress, log=self.log,
            time_budget_s=config.time_budget_s)
        result = loop.run(stop_at)
        summary: dict[str, Any] = {"start_step": result.start_step, "stopped": result.stopped}
        if result.first_eval is not None:
            summary["first_heldout_pass_rate"] = result.first_eval.get("heldout_pass_rate")
        if result.last_eval is not None:
            summary["last_heldout_pass_rate"] = result.last_eval["heldout_pass_rate"]
        summary["steps"] = result.steps
        return summary


# Below this, picking among the policy's own samples adds next to nothing: RL has no signal to find.
LOW_HEADROOM = 0.05


def headroom_lines(scores: dict[str, Any]) -> list[str]:
    """What evaluate_headroom found, in words; a policy without headroom is named as such."""
    if not scores:
        return []
    lines = [f"held-out greedy pass@1 {scores['heldout_pass_rate']:.3f} on {scores['heldout_tasks']} tasks"]
    if "heldout_pass_at_k" in scores:
        k = scores["heldout_samples"]
        lines[0] += (f"; sampled pass@1 {scores['heldout_sampled_pass_rate']:.3f}, pass@{k} "
                     f"{scores['heldout_pass_at_k']:.3f} on {scores['heldout_sampled_tasks']} (headroom "
                     f"{scores['heldout_headroom']:+.3f})")
        if scores["heldout_headroom"] < LOW_HEADROOM:
            lines.append(f"NO HEADROOM: pass@{k} is within {LOW_HEADROOM} of pass@1, so groups of {k} are mostly "
                         f"all-pass or all-fail and RL has little to learn from; start from a policy whose samples "
                         f"solve what its greedy answer misses (docs/rl.md, 'Headroom')")
    return lines


def plot_rl_metrics(metrics_path, png_path) -> None:
    """Reward and pass rates, lengths, tool calls and errors, entropy / clip fraction / logprob gap."""
    records = read_metrics(metrics_path)
    fig, axes = figure_grid()
    panels = [(axes[0][0], ("reward_mean", "pass_rate", "heldout_pass_rate", "heldout_sampled_pass_rate",
                            "heldout_pass_at_k"), "reward / pass rate"),
              (axes[0][1], ("response_tokens", "episode_tokens"), "tokens per episode"),
              (axes[1][0], ("tool_calls", "tool_errors", "turns"), "per episode"),
              (axes[1][1], ("entropy", "clip_fraction", "logprob_gap", "kl_ref"), "policy")]
    for ax, keys, title in panels:
        for key in keys:
            xs, ys = metric_series(records, key)
            if xs:
                ax.plot(xs, ys, "o-" if key.startswith("heldout") else "-", label=key, linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    save_figure(fig, png_path)
