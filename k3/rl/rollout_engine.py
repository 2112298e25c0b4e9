"""The inference engine RL rollouts run on: over the policy itself or a frozen copy in the rollout dtype, kept
in step with the policy after each update."""

from __future__ import annotations

import torch

from k3.runtime import inference_dtype


def build_engine(model, tokenizer, max_context: int, max_batch: int = 32, cuda_graphs: bool | None = None,
                 record_routing: bool = False):
    """The inference engine over the policy model itself: updates reach it in process, with no copy (call
    weights_changed after each update: its prefix cache holds states computed by the old weights).
    record_routing (MoE models only): the engine records every fed token's experts for routing replay; it
    then runs without CUDA graphs and without its prefix cache."""
    from k3.infer.engine import Engine

    return Engine(model, tokenizer, max_context=max_context, max_batch=max_batch, use_cuda_graphs=cuda_graphs,
                  record_routing=record_routing and bool(model.routers()))


def rollout_copy(model, dtype: str):
    """The model the in-process engine runs: ``model`` itself when it already has the rollout dtype, else a
    frozen copy in that dtype (the inference CLIs' --dtype rule: auto = bf16 on CUDA, fp32 elsewhere)."""
    import copy

    weight = next(model.parameters())
    want = inference_dtype(dtype, weight.device)
    if want == weight.dtype:
        return model
    return copy.deepcopy(model).to(want).eval().requires_grad_(False)


@torch.no_grad()
def sync_rollout_copy(copy_model, model) -> None:
    """Copy the policy's weights (and buffers: the balancers' biases) into the rollout copy, in place, so
    captured CUDA graphs keep reading the right addresses."""
    for mine, theirs in zip(copy_model.parameters(), model.parameters()):
        mine.copy_(theirs)
    for mine, theirs in zip(copy_model.buffers(), model.buffers()):
        mine.copy_(theirs)


def weights_changed(engine) -> None:
    """Tell the engine its model's weights moved: cached prefix states are stale."""
    clear = getattr(engine, "clear_prefix_cache", None)
    if clear is not None:
        clear()
