"""Stable LatentMoE: sigmoid router on the full hidden state, routed experts in a latent width, shared
experts at full width.

    scores = sigmoid(W_r x)                     (fp32, over all E experts, on the full hidden state)
    chosen = topk(scores + b, k)                (b: balancing bias, used for selection only)
    w      = scores[chosen] / sum * scale       (gate weights are the unbiased scores)
    y      = up(RMSNorm(sum_k w_k expert_k(down(x)))) + shared(x)

Without a latent width (Kimi Linear) down/up/norm vanish and experts run at full width.

Shape suffixes (legend): B batch, T tokens (flattened B*T), D hidden, L expert input width (latent or D),
E experts, K top-k, N = T*K routed pairs, F expert intermediate width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3.config import ModelConfig
from k3.layers.balancing import (QB_PUBLISHED, QB_SYNC_EVERY, QB_TOLERANCE, loss_free_bias, maxvio,
                                  published_bias, published_bias_histogram, solve_batch_bias,
                                  solve_batch_bias_on_device)
from k3.layers.mlp import GLUMLP
from k3.layers.norm import RMSNorm
from k3.layers.fused_weights import Group, fusable, fused, linear_group
from k3.ops.fused_backend import with_torch_fallback
from k3.ops.glu import glu_activation
from k3.ops.linear_triton import linear, project
from k3.ops.moe import (combine_from_expert_order, count_per_expert, experts_in_either_order, inverse_permutation,
                        unpermute_rows)
from k3.ops.moe_combine import weighted_sum_over_k
from k3.ops.qb_triton import topk_with_load
from k3.ops.shared_input_linear import joins_projections, linears_of_one_input
from k3.ops.route_triton import route_triton, route_triton_pays, router_backend
from k3.ops.route_weights import route_weights_torch, route_weights_triton
from k3.ops.route_weights import triton_chosen as route_weights_fused
from k3.ops.router_logits import router_logits


# Inside a compiled step, up to this many tokens take the router's fp32 logits as a product and a sum over the
# hidden width, which Inductor emits as one reduction kernel reading the weight in its own dtype. As a matmul
# they were the weight's fp32 copy and cuBLAS's dot + reduce (1 token) or split-K SIMT GEMM + reduce (64 tokens).
# Measured on one H200 (bench/moe_decode.py --router, `small`'s router, one graph over 15 layers): 1.7 against
# 6.2 us at 1 token, 2.0 against 8.9 at 8, 3.8 against 10.2 at 64; larger counts were not measured.
COMPILED_LOGITS_MAX_TOKENS = 64


def logits_as_reduction(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """x.float() @ W.float().t() written as a product and a sum over D: one Inductor reduction when compiled."""
    return (x_TD.float()[:, None, :] * weight_ED.float()[None]).sum(-1)


@dataclass
class Routing:
    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    scores_TE: torch.Tensor
    # The logits the scores are the sigmoid of, where the gate weights may come from them (Router.gate_weights).
    logits_TE: torch.Tensor | None = None


class Router(nn.Module):
    """Named like published checkpoints: `gate.weight` [E, D] and `gate.e_score_correction_bias` [E]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts), persistent=True)
        self.renormalize = config.router_renormalize
        self.scale = config.routed_scaling_factor
        self.balancing = config.moe_balancing
        self.gamma = config.loss_free_gamma
        self.force_balanced = False  # debug: ignore scores, deal tokens round-robin to experts
        # QB across data-parallel ranks: concatenates the required-bias matrix over ranks (set by
        # k3.distributed), so every rank solves the same bias from the global batch.
        self.gather = None
        # At scale, gathering [T, E] from every rank is too much: `reduce(tensor, op)` (an all-reduce with
        # op "sum" / "min" / "max") switches QB to histogram aggregation, E*bins numbers per round.
        self.reduce = None
        # QB_PUBLISHED (0): the published rule, one update per training forward from this batch, applied from the
        # next step on (update_bias). N > 0: the research option, the update iterated on the routed batch until it
        # balances or N updates (host syncs); 1 is a single update on the current batch.
        self.qb_max_iters = QB_PUBLISHED
        # The published rule's bias for the next step, left by the last training forward for update_bias.
        self._qb_next_bias: torch.Tensor | None = None
        self.qb_tolerance = QB_TOLERANCE
        # When set (k3.train.graphed_step), QB runs exactly this many updates with its stopping test on the
        # device (solve_batch_bias_on_device): no host sync, so the forward can be captured in a CUDA graph.
        self.qb_device_updates: int | None = None
        # Updates the last training forward used: an int, or a 0-dim tensor with qb_device_updates.
        self.last_qb_iters: int | torch.Tensor = 0
        # Auxiliary balancing loss (Switch / DeepSeek style), an ablation baseline set by the trainer: when > 0,
        # each training forward leaves coef * E * sum_e f_e * P_e in `aux_loss` (f_e: share of the routed pairs,
        # P_e: mean normalised score), which the trainer adds to the LM loss.
        self.aux_loss_coef = 0.0
        self.aux_loss: torch.Tensor | None = None
        # Loads of the training forwards since the last loss-free update.
        self._pending_load: torch.Tensor | None = None
        # The last forward's load, or (after the fused kernel, which does not count) its ids, counted when asked.
        self._last_load_E: torch.Tensor | None = None
        self._last_ids_TK: torch.Tensor | None = None

    @property
    def last_load_E(self) -> torch.Tensor | None:
        """Routed pairs per expert [E] (fp32) of the last forward."""
        if self._last_load_E is None and self._last_ids_TK is not None:
            self._last_load_E = count_per_expert(self._last_ids_TK, self.num_experts).float()
        return self._last_load_E

    def forward(self, x_TD: torch.Tensor) -> Routing:
        # Inference on CUDA: the whole router as one kernel (k3.ops.route_triton). Forward hooks (routing record
        # and replay, the engine's record_routing) see the same Routing either way.
        if not self.training and not self.force_balanced and route_triton_pays(x_TD, self.weight):
            if router_backend() == "triton":
                return self._route_fused(x_TD)
            variant = ("moe_route_triton", tuple(self.weight.shape), self.top_k, x_TD.dtype)
            return with_torch_fallback(variant, lambda: self._route_fused(x_TD), lambda: self._route(x_TD))
        return self._route(x_TD)

    def _route_fused(self, x_TD: torch.Tensor) -> Routing:
        if torch.compiler.is_compiling() and x_TD.shape[0] <= COMPILED_LOGITS_MAX_TOKENS:
            logits_TE = logits_as_reduction(x_TD, self.weight)  # (see COMPILED_LOGITS_MAX_TOKENS)
        else:
            logits_TE = router_logits(x_TD, self.weight)  # as _route computes them
        ids_TK, weights_TK, scores_TE = route_triton(logits_TE, self.e_score_correction_bias, self.top_k,
                                                     self.renormalize, self.scale)
        self._last_ids_TK, self._last_load_E, self.aux_loss = ids_TK, None, None
        return Routing(ids_TK, weights_TK, scores_TE)

    def _route(self, x_TD: torch.Tensor) -> Routing:
        logits_TE = router_logits(x_TD, self.weight)
        scores_TE = torch.sigmoid(logits_TE)
        if self.force_balanced:
            t = torch.arange(x_TD.shape[0], device=x_TD.device)
            topk_ids_TK = (t[:, None] * self.top_k + torch.arange(self.top_k, device=x_TD.device)) % self.num_experts
            load_E = count_per_expert(topk_ids_TK, self.num_experts).float()
        else:
            published = self.training and self.balancing == "quantile" and self.qb_max_iters == QB_PUBLISHED
            if published:
                top = self._route_published_qb(scores_TE.detach())
            elif self.training and self.balancing == "quantile":
                # QB balances the batch being routed: the bias is solved from this batch's scores before the
                # selection, iterating the update to its fixed point (one update from the previous batch's
                # bias lags behind the moving cutoffs and a router that is still moving).
                with torch.no_grad():
                    if self.qb_device_updates is not None:
                        if self.gather is not None or self.reduce is not None:
                            raise ValueError("QB over data-parallel ranks needs the host-side solver; set "
                                             "qb_device_updates = None (no CUDA-graph capture of the step)")
                        new_bias, self.last_qb_iters = solve_batch_bias_on_device(
                            scores_TE.detach(), self.e_score_correction_bias, self.top_k, self.qb_device_updates,
                            tolerance=self.qb_tolerance)
                    else:
                        new_bias, self.last_qb_iters = solve_batch_bias(
                            scores_TE.detach(), self.e_score_correction_bias, self.top_k, self.qb_max_iters,
                            gather=self.gather, reduce=self.reduce, tolerance=self.qb_tolerance,
                            sync_every=QB_SYNC_EVERY if scores_TE.is_cuda else 1)
                    self.e_score_correction_bias.copy_(new_bias)
            if not published:
                # The selection and its load in one call (one kernel on CUDA, k3.ops.qb_triton), counted on the
                # device without a host sync.
                top = topk_with_load(scores_TE.detach(), self.e_score_correction_bias, self.top_k, self.top_k)
            topk_ids_TK, load_E = top.indices[:, :self.top_k].contiguous(), top.load_E
        weights_TK = self.gate_weights(logits_TE, scores_TE, topk_ids_TK)
        self._last_load_E, self._last_ids_TK = load_E, None
        self.aux_loss = None
        if self.training and self.aux_loss_coef > 0:
            share_E = load_E / load_E.sum().clamp_min(1.0)
            mean_score_E = (scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)).mean(0)
            self.aux_loss = self.aux_loss_coef * self.num_experts * (share_E * mean_score_E).sum()
        if self.training and self.balancing == "loss_free":
            self._pending_load = load_E if self._pending_load is None else self._pending_load + load_E
        return Routing(topk_ids_TK, weights_TK, scores_TE, logits_TE)

    def gate_weights(self, logits_TE: torch.Tensor | None, scores_TE: torch.Tensor,
                     ids_TK: torch.Tensor) -> torch.Tensor:
        """The gate weights [T, K] of experts ids [T, K]: their scores (sigmoid of the logits [T, E]), renormalised
        and scaled. Two kernels forward and backward from the logits (k3.ops.route_weights) when chosen; else, or
        without logits, the twin's ops on the scores. With the auxiliary loss the scores need their own gradient
        through the sigmoid, so the twin's ops stay."""
        if (logits_TE is not None and route_weights_fused(logits_TE)
                and not (self.training and self.aux_loss_coef > 0)):
            return route_weights_triton(logits_TE, ids_TK, self.renormalize, self.scale)
        return route_weights_torch(scores_TE, ids_TK, self.renormalize, self.scale)

    @torch.no_grad()
    def _route_published_qb(self, scores_TE: torch.Tensor):
        """The selection with the current bias and, from the same top-(k+1), the published QB update for the next
        step (kept in _qb_next_bias until update_bias). Returns the TopkLoad (k + 1 picks, load of the first k)."""
        top = topk_with_load(scores_TE, self.e_score_correction_bias, self.top_k + 1, self.top_k)
        if self.reduce is not None:
            self._qb_next_bias = published_bias_histogram(scores_TE, self.e_score_correction_bias, self.top_k,
                                                          self.reduce, top=top)
        else:
            self._qb_next_bias = published_bias(scores_TE, self.e_score_correction_bias, self.top_k, top=top,
                                                gather=self.gather)
        self.last_qb_iters = 1
        return top

    @torch.no_grad()
    def update_bias(self, all_reduce=None) -> None:
        """The step-end balancing update. Published QB applies the bias its last training forward computed (the
        iterated QB solves it inside each training forward and needs none); the loss-free sign update applies
        here from the loads since the last call. `all_reduce` sums loads over data-parallel ranks. In eval mode
        the bias is frozen: pending statistics are dropped."""
        if self.training and self.balancing == "quantile" and self._qb_next_bias is not None:
            self.e_score_correction_bias.copy_(self._qb_next_bias)
        self._qb_next_bias = None
        if self.training and self.balancing == "loss_free" and self._pending_load is not None:
            load_E = self._pending_load.clone()
            if all_reduce is not None:
                all_reduce(load_E)
            self.e_score_correction_bias.copy_(loss_free_bias(load_E, self.e_score_correction_bias, self.gamma))
        self._pending_load = None

    def maxvio(self) -> float | None:
        return None if self.last_load_E is None else maxvio(self.last_load_E)

    # What a training forward leaves on the router in Python (loads, aux loss, QB's count and next bias).
    _FORWARD_STATE = ("_pending_load", "_last_load_E", "_last_ids_TK", "aux_loss", "last_qb_iters", "_qb_next_bias")

    def forward_state(self) -> dict[str, object]:
        """What the last training forward left on the router, for restore_forward_state: a CUDA-graph replay of
        the step (k3.train.graphed_step) runs no Python, so it hands the captured forward's tensors back."""
        return {name: getattr(self, name) for name in self._FORWARD_STATE}

    def restore_forward_state(self, state: dict[str, object]) -> None:
        """Put back what forward_state() returned (the tensors' contents are whatever the replay wrote)."""
        unknown = set(state) - set(self._FORWARD_STATE)
        if unknown:
            raise ValueError(f"not a Router forward state: {sorted(unknown)}; expected keys {self._FORWARD_STATE}")
        for name, value in state.items():
            setattr(self, name, value)

    def drop_pending_updates(self) -> None:
        """Forget the loads and the QB bias that earlier training forwards left for update_bias."""
        self._pending_load = self._qb_next_bias = None


def unpermute(y_ND: torch.Tensor, order_N: torch.Tensor) -> torch.Tensor:
    """Rows computed in `order_N` order (y_ND[i] belongs to pair order_N[i]) back in pair order."""
    return unpermute_rows(y_ND, order_N, inverse_permutation(order_N))


class LatentMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, latent = config.hidden_size, config.moe_latent_size
        width_in = latent or d
        e, f = config.num_experts, config.moe_intermediate_size
        self.gate = Router(config)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps) if config.moe_latent_norm else None
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        self.latent = latent is not None
        # Experts stacked: w1 gate [E, F, L], w3 up [E, F, L], w2 down [E, L, F].
        self.w1 = nn.Parameter(torch.empty(e, f, width_in))
        self.w3 = nn.Parameter(torch.empty(e, f, width_in))
        self.w2 = nn.Parameter(torch.empty(e, width_in, f))
        self.shared_experts = GLUMLP(config, d, config.shared_width) if config.num_shared_experts > 0 else None
        self.act = config.hidden_act
        self.betas = (config.situ_beta_gate, config.situ_beta_up)
        self.top_k = config.num_experts_per_tok

    def routed(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed path alone: [T, D] -> [T, D]."""
        h_TL = project(self.routed_expert_down_proj, x_TD) if self.latent else x_TD
        out_TL = self.routed_latent(h_TL, routing)
        if self.latent:
            return project(self.routed_expert_up_proj, self._latent_norm(out_TL))
        return out_TL

    def routed_latent(self, h_TL: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts and their gate-weighted sum, in the expert width: [T, L] -> [T, L] (expert parallelism
        overrides this part alone)."""
        num_tokens = h_TL.shape[0]
        ids_N = routing.topk_ids_TK.reshape(-1)
        w13 = fused(self, "w13")  # w1 and w3 in one buffer when fused at load (k3.layers.fused_weights)
        y_NL, expert_order = experts_in_either_order(h_TL, ids_N, self.top_k, self.w1, self.w3, self.w2, self.act,
                                                     self.betas, w13.buffer if w13 is not None else None)
        if expert_order is not None:  # the sorted path: combined from expert order, no copy back to pair order
            return combine_from_expert_order(y_NL, expert_order.inverse_N, routing.topk_weights_TK,
                                             expert_order.order_N)
        # The width spelled out (not -1): with no tokens, a view of 0 elements cannot infer it.
        y_TKL = y_NL.view(num_tokens, self.top_k, y_NL.shape[-1])
        return weighted_sum_over_k(y_TKL, routing.topk_weights_TK)

    def _latent_norm(self, out_TL: torch.Tensor) -> torch.Tensor:
        return self.routed_expert_norm(out_TL) if self.routed_expert_norm is not None else out_TL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        x_TD = x.reshape(-1, x.shape[-1])
        routing = self.gate(x_TD)
        groups = self._fused_projections()
        if groups is not None:
            return self._forward_fused(x_TD, routing, *groups).view(x.shape)
        if self._joins_input_projections(x_TD):
            return self._forward_joined_input(x_TD, routing).view(x.shape)
        out = self.routed(x_TD, routing).view(x.shape)
        # The result must not be a view: FSDP2 hooks a unit's output for backward, and an in-place op on a
        # view would drop that hook. Adding the shared experts makes a new tensor; without them, a copy does.
        return out + self.shared_experts(x) if self.shared_experts is not None else out.clone()

    def _joins_input_projections(self, x_TD: torch.Tensor) -> bool:
        """Training over many tokens: the latent down projection and the shared expert's gate and up as one GEMM
        with an accumulating backward (k3.ops.shared_input_linear), where autograd would add three dx."""
        shared = self.shared_experts
        if not self.latent or shared is None:
            return False
        return joins_projections(x_TD, (self.routed_expert_down_proj, shared.gate_proj, shared.up_proj), (shared,))

    def _forward_joined_input(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        shared = self.shared_experts
        h_TL, gate, up = linears_of_one_input(
            x_TD, [self.routed_expert_down_proj.weight, shared.gate_proj.weight, shared.up_proj.weight])
        out_TD = project(self.routed_expert_up_proj, self._latent_norm(self.routed_latent(h_TL, routing)))
        return out_TD + project(shared.down_proj, glu_activation(gate, up, shared.act, *shared.betas))

    def fusable_groups(self) -> list[Group]:
        """Weight groups for k3.layers.fused_weights: w1 and w3 as one grouped GEMM; with a latent width and
        shared experts, also the projections around the experts, both or neither: the latent down projection
        and the shared expert's gate and up all read x (one GEMM), and the latent up projection and the shared
        expert's down projection are summed into the output (one GEMM over their inputs side by side)."""
        groups: list[Group] = [("experts", "w13", [(self, "w1"), (self, "w3")], 1)]
        shared = self.shared_experts
        if not self.latent or shared is None:
            return groups
        inputs = [(self.routed_expert_down_proj, "weight"), (shared.gate_proj, "weight"), (shared.up_proj, "weight")]
        outputs = [(self.routed_expert_up_proj, "weight"), (shared.down_proj, "weight")]
        if fusable(inputs) and fusable(outputs):
            groups += [("moe_input", "input", inputs, 0), ("moe_output", "output", outputs, 1)]
        return groups

    def _fused_projections(self):
        """The usable (input, output) groups, or None: then every projection runs as its own module."""
        inputs, outputs = fused(self, "input"), fused(self, "output")
        if inputs is None or outputs is None:
            return None
        shared = self.shared_experts
        modules = (self.routed_expert_down_proj, self.routed_expert_up_proj, shared, shared.gate_proj,
                   shared.up_proj, shared.down_proj)
        if any(m._forward_hooks or m._forward_pre_hooks for m in modules):  # a hook must see its module run
            return None
        return inputs, outputs

    def _forward_fused(self, x_TD: torch.Tensor, routing: Routing, inputs, outputs) -> torch.Tensor:
        """up(norm(routed)) + down(act(gate, up)) with two GEMMs for the four projections (a decode step runs
        each projection at a few rows: launches, not bytes, are its cost)."""
        h_TL, gate, up = linear_group(x_TD, inputs)
        shared = self.shared_experts
        act = glu_activation(gate, up, shared.act, *shared.betas)
        out_TL = self._latent_norm(self.routed_latent(h_TL, routing))
        return linear(torch.cat([out_TL.to(act.dtype), act], dim=-1), outputs.buffer.to(act.dtype))
