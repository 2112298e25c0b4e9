"""Inference: one engine (continuous batching over a KDA-slot + paged-MLA cache pool, exact prefix caching,
per-request sampling on the device) behind `k3 generate`, `k3 chat`, `k3 serve`, evaluation and RL rollouts."""

from k3.infer.engine import Completion, Engine, RequestOutput, ScoreOutput, TokenEvent, greedy_without_cache
from k3.infer.engine_config import EngineConfig
from k3.infer.sampling import SamplingParams, filter_logits, sample_next

__all__ = ["Engine", "EngineConfig", "AsyncEngine", "QueueFull", "SamplingParams", "Completion", "RequestOutput", "ScoreOutput",
           "TokenEvent", "greedy_without_cache", "filter_logits", "sample_next"]


def __getattr__(name):
    if name in ("AsyncEngine", "QueueFull"):
        from k3.infer import async_engine

        return getattr(async_engine, name)
    raise AttributeError(f"module 'k3.infer' has no attribute {name!r}")
