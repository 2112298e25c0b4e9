"""Rollouts on a Ray cluster: rollout workers as Ray actors, each holding its own copy of the policy, its own
inference engine and its own sandboxes on the node Ray placed it (SPREAD, as k3.sandbox's RayFleet places
its sandbox workers), and the weights pushed to every worker after each update.

    ray.init()                                   # or ray.init(address="HOST:6379")
    rollouts = RayRollouts(model, tokenizer, RolloutConfig(...), workers=4, seed=0)
    groups = rollouts.run(tasks, group_size=8, step=1)    # as RolloutRunner.run
    rollouts.push_weights(model)                 # after the update: every engine samples from the new weights
    rollouts.close()

A step's tasks go round-robin to the workers (task i to worker i mod N); each worker runs its share exactly as
the in-process RolloutRunner would (same snapshot-and-fork per task, same per-episode seeds, which do not
depend on the worker), and the finished groups come back as plain data, ordered by their origin (step, index
of the task in its step), so the trainer sees them in the order one process gives. Parked groups stay on
their worker between steps; ``parked_state`` gathers them (with their sandboxes' snapshots exported from that
worker's layer store) for the checkpoint, and ``restore_parked`` deals them out again (imported there).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from k3.rl.rollout import Episode, RolloutConfig, RolloutRunner, episode_from_state, episode_state
from k3.rl.tasks import Task
from k3.sandbox.paths import path_environment


class RolloutWorker:
    """One rollout worker (a Ray actor): a policy copy, its engine (k3.rl.rollout_engine.build_engine) and a
    RolloutRunner whose sandboxes live on this worker's node."""

    def __init__(self, model_config: dict, state: dict, tokenizer, config: RolloutConfig, seed: int,
                 max_batch: int, record_routing: bool, threads: int, env: dict[str, str], device: str = "cpu",
                 cuda_graphs: bool | None = None, dtype: str = "auto") -> None:
        from k3.config import ModelConfig
        from k3.model import K3ForCausalLM
        from k3.rl.rollout_engine import build_engine
        from k3.runtime import inference_dtype

        os.environ.update(env)
        torch.set_num_threads(max(1, threads))
        self.model = K3ForCausalLM(ModelConfig.from_dict(model_config))
        self.model.load_state_dict(state)
        # The rollout dtype as the in-process engine has it (k3.rl.rollout_engine.rollout_copy): auto = bf16 on CUDA.
        # Pushed fp32 weights are cast on load_state_dict's copy.
        self.model.to(device=device, dtype=inference_dtype(dtype, device)).eval().requires_grad_(False)
        self.engine = build_engine(self.model, tokenizer, config.max_context, max_batch=max_batch,
                                   cuda_graphs=cuda_graphs, record_routing=record_routing)
        self.runner = RolloutRunner(self.engine, tokenizer, config, seed=seed)

    def set_weights(self, state: dict) -> None:
        self.model.load_state_dict(state)
        self.engine.weights_changed()

    def run(self, tasks: list[Task], indices: list[int], group_size: int, step: int,
            temperature: float | None) -> tuple[list[list[dict]], dict]:
        if temperature is None:
            groups = self.runner.run(tasks, group_size, step, indices)
        else:
            groups = self.runner.run_aside(tasks, group_size, step, temperature, indices)
        return [[episode_state(e) for e in group] for group in groups], dict(self.runner.stats)

    def parked_state(self) -> dict:
        return self.runner.parked_state()

    def restore_parked(self, state: dict) -> None:
        self.runner.restore_parked(state)

    def weights_digest(self) -> float:
        """A number that changes with the weights (tests check a push arrived)."""
        return float(sum(p.double().sum() for p in self.model.parameters()))

    def weights_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype)


def merge_stats(stats: list[dict]) -> dict[str, float]:
    """Workers' rollout stats as one step's: counts add up, times are the slowest worker's (they ran at once)."""
    merged: dict[str, float] = {}
    for one in stats:
        for key, value in one.items():
            if key in ("generated_tokens", "parked_groups"):
                merged[key] = merged.get(key, 0) + value
            elif key != "rollout_tokens_per_s":
                merged[key] = max(merged.get(key, 0.0), value)
    generation = merged.get("generation_s", 0.0)
    merged["rollout_tokens_per_s"] = merged.get("generated_tokens", 0) / generation if generation > 0 else 0.0
    return merged


class RayRollouts:
    """RolloutRunner's interface (run, run_aside, parked, stats, parked_state, restore_parked) over ``workers``
    Ray actors; ``push_weights(model)`` after every update. Needs a running Ray (ray.init first)."""

    def __init__(self, model, tokenizer, config: RolloutConfig, workers: int = 2, seed: int = 0,
                 max_batch: int = 32, record_routing: bool = False, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 cuda_graphs: bool | None = None, timeout: float | None = None, dtype: str = "auto") -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayRollouts needs a running Ray: call ray.init() (or ray.init(address=...)) first")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._ray, self.timeout = ray, timeout
        self.config = config
        self.stats: dict[str, float] = {}
        env = path_environment()
        actor = ray.remote(RolloutWorker).options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy="SPREAD")
        state = ray.put(_cpu_state(model))
        threads = max(1, int(num_cpus))
        self.workers = [actor.remote(model.config.to_dict(), state, tokenizer, config, seed, max_batch,
                                     record_routing, threads, env, "cuda" if num_gpus > 0 else "cpu", cuda_graphs,
                                     dtype)
                        for _ in range(workers)]

    def _get(self, refs):
        """ray.get, within ``timeout`` seconds when one was given (a stuck worker then raises GetTimeoutError)."""
        return self._ray.get(refs, timeout=self.timeout)

    @property
    def parked(self) -> list[list[Episode]]:
        """The parked groups of every worker (copies: the workers keep the originals)."""
        state = self.parked_state()
        return [[episode_from_state(e) for e in group] for group in state["groups"]]

    def _run(self, tasks: list[Task], group_size: int, step: int, temperature: float | None,
             indices: list[int] | None) -> list[list[Episode]]:
        origins = indices if indices is not None else list(range(len(tasks)))
        shares = [list(range(w, len(tasks), len(self.workers))) for w in range(len(self.workers))]
        calls = [worker.run.remote([tasks[i] for i in share], [origins[i] for i in share], group_size, step,
                                   temperature) for worker, share in zip(self.workers, shares)]
        results = self._get(calls)
        if temperature is None:
            self.stats = merge_stats([stats for _, stats in results])
        groups = [[episode_from_state(e) for e in group] for states, _ in results for group in states]
        return sorted(groups, key=lambda group: tuple(group[0].origin))

    def run(self, tasks: list[Task], group_size: int, step: int = 0,
            indices: list[int] | None = None) -> list[list[Episode]]:
        return self._run(tasks, group_size, step, None, indices)

    def run_aside(self, tasks: list[Task], group_size: int, step: int, temperature: float,
                  indices: list[int] | None = None) -> list[list[Episode]]:
        return self._run(tasks, group_size, step, temperature, indices)

    def push_weights(self, model) -> None:
        """The trainer's weights to every worker (shipped once through the object store)."""
        state = self._ray.put(_cpu_state(model))
        self._get([worker.set_weights.remote(state) for worker in self.workers])

    def parked_state(self) -> dict[str, Any]:
        states = self._get([worker.parked_state.remote() for worker in self.workers])
        return {"groups": [g for s in states for g in s["groups"]],
                "snapshots": {k: v for s in states for k, v in s["snapshots"].items()}}

    def restore_parked(self, state: dict | None) -> None:
        """Deal saved parked groups out to the workers round-robin (each imports the snapshots it needs)."""
        if not state or not state.get("groups"):
            return
        shares: list[dict] = [{"groups": [], "snapshots": {}} for _ in self.workers]
        for index, group in enumerate(state["groups"]):
            share = shares[index % len(self.workers)]
            share["groups"].append(group)
            for episode in group:
                snapshot = episode.get("parked_snapshot")
                if snapshot is not None:
                    share["snapshots"][snapshot] = state["snapshots"][snapshot]
        self._get([worker.restore_parked.remote(share) for worker, share in zip(self.workers, shares)])

    def weights_dtypes(self) -> list[str]:
        return self._get([worker.weights_dtype.remote() for worker in self.workers])

    def weights_digests(self) -> list[float]:
        return self._get([worker.weights_digest.remote() for worker in self.workers])

    def close(self) -> None:
        for worker in self.workers:
            self._ray.kill(worker)
        self.workers = []


def _cpu_state(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu() for name, value in model.state_dict().items()}
