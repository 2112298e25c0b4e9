"""Inference: sampling, the prefill + cached-decode engine, and the `k3 generate` / `k3 chat` commands."""

from k3.infer.engine import Engine, Session, greedy_without_cache
from k3.infer.sampling import SamplingParams, filter_logits, sample_next

__all__ = ["Engine", "Session", "greedy_without_cache", "SamplingParams", "filter_logits", "sample_next"]
