"""A training step's forward and backward captured once as one CUDA graph and replayed for every later batch.

Why: `small`'s eager training step took 204 and 316 ms on two H200 machines (their hosts differ), of which the GPU
was busy about 170 ms; the rest is the host launching some three thousand kernels (fla's launchers alone spend
about 4 ms of host time per KDA layer) while the GPU waits. A replayed graph launches them all in one call: 178 ms
(BENCHMARKS.md, round eight).

What it needs, and checks where it can:
- batches of one fixed shape (the captured one), no cache; packed documents only in the static form (cu_seqlens
  padded to a fixed count, k3.model.pad_cu_seqlens, passed with max_documents and row_length);
- a forward with no host sync: published QB (one update per step) has none; the iterated QB's solver is switched
  to its device-side form (Router.qb_device_updates, a fixed number of updates, QB_GRAPH_UPDATES unless the router
  already has a count); one rank;
- one micro-batch per optimizer step: a replay overwrites the gradients (they are the graph's own buffers, put
  back on the parameters after every replay, so zero_grad(set_to_none=True) between steps is harmless);
- no dropout or other random ops in the forward (a replay repeats the captured random numbers).

The optimizer step, gradient clipping and the loss-free balancer update stay outside the graph, in eager code.
Python-side state that the forward leaves on the routers (the routed load, the QB update count, the auxiliary
loss) is not re-run by a replay: the tensors the capture wrote are handed back to the routers after each replay,
and the replay refreshes their contents.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from k3.layers.moe import Router

# QB updates per MoE layer in a captured step (each one is computed, balanced or not). With the bias carried
# from the previous step, the host solver took 1.2 updates per layer on average in a profiled `small` step on one
# H200 (48 top-k calls over 15 MoE layers: two per layer plus one per update). A batch still unbalanced after
# these takes the most balanced iterate; the trainer's maxvio metric shows it.
QB_GRAPH_UPDATES = 4


@contextlib.contextmanager
def sync_errors(on: bool):
    """Inside (when on): a CUDA call that waits for the device raises (torch.cuda.set_sync_debug_mode)."""
    if not on:
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


class GraphedTrainStep:
    """step = GraphedTrainStep(model, loss_fn, batch); loss = step(batch): forward + backward of
    loss_fn(model, batch) (a dict of tensors -> a scalar loss) replayed from one CUDA graph; the parameters'
    .grad hold the new gradients afterwards and the returned loss is a fresh tensor. The first call captures
    (after `warmup` eager forward + backward passes on the first batch, which compile and autotune kernels;
    they leave no gradients behind and the model's buffers as they found them)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
                 batch: dict[str, torch.Tensor], warmup: int = 3, qb_updates: int | None = QB_GRAPH_UPDATES) -> None:
        if not torch.cuda.is_available() or not all(t.is_cuda for t in batch.values()):
            raise ValueError("a graphed training step needs CUDA tensors (CUDA graphs); run the eager step on "
                             f"{next(iter(batch.values())).device}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (kernels compile and autotune before capture), got {warmup}")
        self.model, self.loss_fn, self.warmup = model, loss_fn, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        for router in self.routers:
            if router.gather is not None or router.reduce is not None:
                raise ValueError("QB over data-parallel ranks syncs with the host; a graphed step runs on one rank")
            if router.qb_device_updates is None and router.qb_max_iters > 0:  # the iterated rule only
                router.qb_device_updates = qb_updates or QB_GRAPH_UPDATES
        self.static = {name: t.clone() for name, t in batch.items()}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None
        self.grads: list[torch.Tensor | None] = []
        self.router_state: list[dict[str, object]] = []

    def _copy_in(self, batch: dict[str, torch.Tensor]) -> None:
        if batch.keys() != self.static.keys():
            raise ValueError(f"a graphed step takes the captured batch's keys {sorted(self.static)}, got {sorted(batch)}")
        for name, t in batch.items():
            static = self.static[name]
            if t.shape != static.shape or t.dtype != static.dtype:
                raise ValueError(f"batch[{name!r}] is {tuple(t.shape)} {t.dtype}; the graph was captured for "
                                 f"{tuple(static.shape)} {static.dtype} (pad or bucket batches to one shape, or "
                                 "use the eager step)")
            static.copy_(t, non_blocking=True)

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _capture(self) -> None:
        # The warm-up passes must leave no trace: QB moves the routers' bias on every training forward, so every
        # buffer is put back afterwards (a resumed run then replays exactly what the unbroken one did).
        buffers = [(b, b.clone()) for b in self.model.buffers()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as CUDA graph capture asks
            for i in range(self.warmup):
                self._zero_grads()
                # The last pass, with every kernel compiled and tuned, raises at any host sync, naming the op,
                # where the capture would fail with a bare "operation not permitted when stream is capturing".
                with sync_errors(on=i == self.warmup - 1):
                    self.loss_fn(self.model, self.static).backward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        self._zero_grads()
        for router in self.routers:  # the captured load must be this forward's alone
            router.drop_pending_updates()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            loss = self.loss_fn(self.model, self.static)
            loss.backward()
        self.loss = loss.detach()
        self.grads = [p.grad for p in self.params]
        self.router_state = [router.forward_state() for router in self.routers]

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self._copy_in(batch)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        for p, grad in zip(self.params, self.grads):
            p.grad = grad
        for router, state in zip(self.routers, self.router_state):
            router.restore_forward_state(state)
        return self.loss.clone()
