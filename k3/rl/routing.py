"""Routing replay for MoE policies: a forward records the experts every token was routed to, and a later
forward over the same tokens reuses exactly those experts (the gate weights are recomputed from the current
router's scores over the replayed experts, so the router still gets its gradient).

Why: the ratio pi_theta / pi_old compares two forwards of one sequence; with a router that moved between
them, a token's experts can change and the ratio then measures the routing flip, not the policy update.
GRPO on MoE needs replay; GSPO's sequence-level ratio is robust without it.

Both work from outside the model, through forward hooks on every Router (k3.layers.moe): nothing in the model
changes, and outside a ``record`` / ``replay`` block the hooks are gone.

    replay = RoutingReplay(model)
    with replay.record() as routes:      # routes[router_index] = [topk_ids_TK of each call, in order]
        old = model(ids, cu_seqlens=cu)
    with replay.replay(routes):
        new = model(ids, cu_seqlens=cu)  # same experts per token as the recorded forward

Routes may also come from elsewhere: the inference engine records the experts of every token it fed
(``Engine(record_routing=True)``, Completion.routing), and ``rollout_routes`` turns those of packed sequences
into the one-call-per-layer form ``replay`` takes. A row of -1 is a token nobody recorded (the last token of
a sequence is never fed to the engine): it keeps the router's own choice.
"""

from __future__ import annotations

import contextlib

import torch

from k3.layers.moe import Routing


class RoutingReplay:
    def __init__(self, model) -> None:
        self.routers = [router for _, router in model.routers()]

    @contextlib.contextmanager
    def record(self):
        routes: list[list[torch.Tensor]] = [[] for _ in self.routers]
        handles = []
        for index, router in enumerate(self.routers):
            def hook(module, args, output, index=index):
                routes[index].append(output.topk_ids_TK.detach().clone())
            handles.append(router.register_forward_hook(hook))
        try:
            yield routes
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def replay(self, routes: list[list[torch.Tensor]]):
        if len(routes) != len(self.routers):
            raise ValueError(f"recorded routes cover {len(routes)} MoE layers but the model has {len(self.routers)}")
        calls = [0] * len(self.routers)
        handles = []
        for index, router in enumerate(self.routers):
            def hook(module, args, output, index=index):
                if calls[index] >= len(routes[index]):
                    raise RuntimeError(f"MoE layer {index} was called {calls[index] + 1} times but only "
                                       f"{len(routes[index])} calls were recorded: replay the same forwards")
                ids_TK = routes[index][calls[index]].to(output.scores_TE.device)
                calls[index] += 1
                if ids_TK.shape[0] != output.scores_TE.shape[0]:
                    raise RuntimeError(f"MoE layer {index}: recorded {ids_TK.shape[0]} tokens, this forward has "
                                       f"{output.scores_TE.shape[0]}: replay needs the same token layout")
                # Rows the recording did not see (-1) keep the router's own choice; done for every row rather
                # than after an any() test, which would sync the host with the device once per MoE layer.
                ids_TK = torch.where(ids_TK[:, :1] >= 0, ids_TK, output.topk_ids_TK)
                # The router's own gate weights for these ids (the same ops or kernels as a forward without replay).
                weights_TK = module.gate_weights(output.logits_TE, output.scores_TE, ids_TK)
                return Routing(ids_TK, weights_TK, output.scores_TE, output.logits_TE)
            handles.append(router.register_forward_hook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def rollout_routes(routings: list[torch.Tensor], lengths: list[int]) -> list[list[torch.Tensor]]:
    """Per-sequence rollout routing ([L, n_i, K] expert ids, n_i <= length_i; missing tail rows and -1 rows are
    unknown) of sequences packed in one row -> ``replay``'s routes: per MoE layer, one [sum length_i, K] call."""
    if len(routings) != len(lengths):
        raise ValueError(f"{len(routings)} routings for {len(lengths)} sequences")
    layers, _, k = routings[0].shape
    rows = []
    for routing, length in zip(routings, lengths):
        if routing.shape[0] != layers or routing.shape[2] != k:
            raise ValueError(f"routing of shape {list(routing.shape)} does not match [{layers}, n, {k}]")
        if routing.shape[1] > length:
            raise ValueError(f"routing covers {routing.shape[1]} tokens of a {length}-token sequence")
        pad = torch.full((layers, length - routing.shape[1], k), -1, dtype=torch.long)
        rows.append(torch.cat([routing.long(), pad], 1))
    packed = torch.cat(rows, 1)
    return [[packed[layer]] for layer in range(layers)]
