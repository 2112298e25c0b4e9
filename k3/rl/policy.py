"""The trainer side of RL: logprobs of sampled sequences under the policy, and one policy-gradient update.

Sequences are packed into one row ([1, total], cu_seqlens: no padding, no leakage between them), in
micro-batches of at most ``micro_tokens`` tokens. Per update:

1. with several mini-batches, the old-policy pass (no grad): logprobs under the weights that sampled, with
   each token's experts recorded (routing replay), and the reference model's logprobs when a KL term is on.
   When the sequences carry the rollout engine's routing (Sequence.routing), this pass already replays it, so
   both the old and the new logprobs route every token as the rollout did (tokens the engine never fed keep
   the old policy's choice). With one mini-batch (the default) there is no such pass: the old logprobs are
   the training forward's own, detached, so the first ratio is exactly 1 (a separate no-grad pass can take
   other kernels than the grad-mode one on CUDA, and GSPO's 3e-4 band then clips on that noise);
2. per mini-batch: the training forward (replaying the recorded experts), the algorithm's loss on tokens the
   policy produced only (tool output and prompts are masked out), backward, clip, one optimizer step.

Logprobs are taken at the rollout's sampling temperature (logits / T), as the engine reports them
(k3.infer.sampling): the samples come from softmax(z / T), not softmax(z).

The Quantile-Balancing bias stays frozen during RL (routers run in eval mode, where QB does not solve a new
bias) unless ``update_balancer`` is set.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3.data.packing import filler_length
from k3.rl.losses import ALGORITHMS, LossConfig, kl_k3, tis_weights
from k3.rl.routing import RoutingReplay


@dataclass
class Sequence:
    """One trainable sample: ids [n], mask [n] (True: produced by the policy), rollout logprobs [n] (NaN where
    unknown; unused where mask is False) and its advantage."""

    ids: list[int]
    mask: list[bool]
    rollout_logprobs: list[float]
    advantage: float
    routing: torch.Tensor | None = None  # the rollout's experts [MoE layers, n' <= n, K]; -1 rows: unknown


def token_logprobs(logits_TV: torch.Tensor, ids_T: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from logits [T, V] of one sequence -> [T] (position 0 is 0)."""
    logp = torch.zeros(ids_T.shape[0], device=logits_TV.device, dtype=torch.float32)
    if ids_T.shape[0] > 1:
        logp[1:] = torch.log_softmax(logits_TV[:-1].float(), -1).gather(1, ids_T[1:, None]).squeeze(1)
    return logp


def token_entropy(logits_TV: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, aligned as token_logprobs ([T], position 0 is
    0): entry t is the entropy of the distribution that token t was drawn from."""
    out = torch.zeros(logits_TV.shape[0], device=logits_TV.device, dtype=torch.float32)
    if logits_TV.shape[0] > 1:
        logp = torch.log_softmax(logits_TV[:-1].float(), -1)
        out[1:] = -(logp.exp() * logp).sum(-1)
    return out


def micro_batches(lengths: list[int], micro_tokens: int) -> list[list[int]]:
    """Indices grouped in order into batches of at most micro_tokens tokens (a longer sequence goes alone)."""
    batches, current, used = [], [], 0
    for index, length in enumerate(lengths):
        if current and used + length > micro_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        batches.append(current)
    return batches


def packed_logprobs(model, sequences: list[list[int]], device, with_entropy: bool = False, autocast=None,
                    filler: int = 0, temperature: float = 1.0):
    """Forward sequences packed in one row -> (list of logprobs [n_i], list of entropies [n_i] or None), both
    of softmax(logits / temperature), the distribution the rollout sampled from. filler > 0 appends one more
    document of that many tokens (id 0) to the row, whose results are dropped: the packed length then stays
    on a few values (k3.data.packing.filler_length)."""
    if filler:
        sequences = [*sequences, [0] * filler]
    ids = torch.tensor([t for s in sequences for t in s], device=device)[None]
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        logits = model(ids, cu_seqlens=cu).logits[0]
    if temperature != 1.0:
        logits = logits.float() / temperature
    logps, entropies = [], []
    for i in range(len(sequences) - (1 if filler else 0)):
        start, end = int(cu[i]), int(cu[i + 1])
        logps.append(token_logprobs(logits[start:end], ids[0, start:end]))
        if with_entropy:
            with torch.no_grad():
                entropies.append(token_entropy(logits[start:end].detach()))
    return logps, (entropies if with_entropy else None)


def pad(rows: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """[n_i] tensors -> [B, max n] padded with value."""
    width = max(r.shape[0] for r in rows)
    return torch.stack([F.pad(r, (0, width - r.shape[0]), value=value) for r in rows])


@dataclass
class PolicyConfig:
    """The policy update's settings; each field's docstring is its `k3 rl` --help text."""

    algorithm: str = "gspo"
    """the policy objective (k3.rl.losses.ALGORITHMS)"""
    lr: float = 1e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this"""
    minibatches: int = 1
    """optimizer steps per batch of rollouts (>1: later ones are off-policy, ratios clip)"""
    micro_tokens: int = 8192
    """tokens of one packed forward and backward"""
    temperature: float = 1.0
    """the rollout's sampling temperature: logprobs of softmax(logits / temperature)"""
    routing_replay: bool = True
    """the update's MoE layers route each token to the experts it took when sampled"""
    update_balancer: bool = False
    """let the update move the routers' Quantile-Balancing biases (frozen during RL otherwise)"""
    # Packed micro-batches padded to a multiple of this many tokens (k3.data.packing.filler_length); None:
    # PACK_MULTIPLE_CUDA on CUDA, 0 (no padding) elsewhere.
    pack_multiple: int | None = None


class PolicyUpdater:
    """Owns the optimizer; ``update(sequences)`` does one RL update over a batch and returns its metrics."""

    def __init__(self, model, config: PolicyConfig, loss_config: LossConfig, optimizer=None, reference=None,
                 autocast=None) -> None:
        from k3.train.optim import build_optimizer

        if config.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown RL algorithm {config.algorithm!r}; choose one of {sorted(ALGORITHMS)}")
        self.model, self.config, self.loss_config = model, config, loss_config
        self.algorithm = ALGORITHMS[config.algorithm]
        self.optimizer = optimizer or build_optimizer(model, config.lr, config.weight_decay)
        self.reference = reference
        self.autocast = autocast
        self.device = next(model.parameters()).device
        self.replay = RoutingReplay(model)

    def _train_mode(self) -> None:
        self.model.train()
        if not self.config.update_balancer:
            for _, router in self.model.routers():
                router.eval()  # QB solves a new bias only in training mode: frozen during RL

    def _filler(self, members: list[Sequence]) -> int:
        """Filler tokens that pad the members' packed row (see PolicyConfig.pack_multiple)."""
        return filler_length(sum(len(s.ids) for s in members), self.config.pack_multiple, self.device)

    def _rollout_routes(self, members: list[Sequence], filler: int = 0):
        """replay's routes from the members' rollout routing, or None when none of them has any; a filler
        document at the end of the row gets unknown (-1) routes, i.e. the router's own choice."""
        from k3.rl.routing import rollout_routes

        known = [s.routing for s in members if s.routing is not None]
        if not known or not self.replay.routers:
            return None
        layers, _, k = known[0].shape
        empty = torch.empty(layers, 0, k, dtype=torch.long)
        self.rollout_routed += sum(int((s.routing[0, :, 0] >= 0).sum()) for s in members if s.routing is not None)
        routings = [s.routing if s.routing is not None else empty for s in members]
        lengths = [len(s.ids) for s in members]
        if filler:
            routings, lengths = routings + [empty], lengths + [filler]
        return rollout_routes(routings, lengths)

    def _all_reduce_grads(self, bucket: int = 1 << 24) -> None:
        """Sum every gradient over the ranks (data parallel: each rank backpropagated its own sequences, with
        shares of the global batch), in flat buckets of about ``bucket`` elements."""
        from k3.distributed.launch import all_reduce_sum

        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a rank without sequences in this mini-batch still adds its zeros
                p.grad = torch.zeros_like(p)
        start = 0
        while start < len(params):
            end, size = start, 0
            while end < len(params) and (size == 0 or size + params[end].numel() <= bucket):
                size += params[end].numel()
                end += 1
            flat = torch.cat([p.grad.reshape(-1) for p in params[start:end]])
            all_reduce_sum(flat)
            offset = 0
            for p in params[start:end]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            start = end

    def _logprobs(self, model, members: list[int], sequences: list[Sequence], filler: int,
                  with_entropy: bool = False):
        return packed_logprobs(model, [sequences[i].ids for i in members], self.device, with_entropy=with_entropy,
                               autocast=self.autocast, filler=filler, temperature=self.config.temperature)

    def _rollout_replay(self, members: list[int], sequences: list[Sequence], filler: int):
        """Replay of the rollout's recorded experts over these members (nothing to replay: a null context)."""
        rollout = (self._rollout_routes([sequences[i] for i in members], filler) if self.config.routing_replay
                   else None)
        return self.replay.replay(rollout) if rollout is not None else contextlib.nullcontext()

    @torch.no_grad()
    def _reference_logprobs(self, members: list[int], sequences: list[Sequence], filler: int, into: dict) -> None:
        if self.reference is not None and self.loss_config.kl_coef > 0:
            refs, _ = self._logprobs(self.reference, members, sequences, filler)
            into.update(zip(members, refs))

    def update(self, sequences: list[Sequence]) -> dict[str, float]:
        """One update over ``sequences``. Under torch.distributed (torchrun) every rank passes its own share of
        the batch (possibly none) and every rank must call: the losses are normalised by the global batch,
        the gradients summed over the ranks, so each rank takes the step one process would over all of them."""
        from k3.distributed.launch import all_reduce_sum, is_distributed

        data_parallel = is_distributed()
        if not sequences and not data_parallel:
            return {}
        config = self.config
        self._train_mode()
        order = list(range(len(sequences)))
        count = config.minibatches if data_parallel else min(config.minibatches, len(order))
        minibatches = [order[i::config.minibatches] for i in range(count)]
        one_pass = config.minibatches == 1  # old logprobs = the training forward's, detached
        old_logp, entropy, routes, ref_logp = {}, {}, {}, {}
        self.rollout_routed = 0
        if not one_pass:  # 1. the old-policy pass: logprobs, entropy, recorded routes, reference logprobs
            # In grad mode like the training pass (its graph dropped at once): on CUDA some kernels are chosen by
            # grad mode, and the first mini-batch's ratio must be exactly 1.
            with torch.enable_grad():
                for mb in minibatches:
                    for micro in micro_batches([len(sequences[i].ids) for i in mb], config.micro_tokens):
                        members = [mb[i] for i in micro]
                        filler = self._filler([sequences[i] for i in members])
                        with self._rollout_replay(members, sequences, filler), self.replay.record() as recorded:
                            logps, ents = self._logprobs(self.model, members, sequences, filler, with_entropy=True)
                        routes[tuple(members)] = recorded
                        self._reference_logprobs(members, sequences, filler, ref_logp)
                        old_logp.update(zip(members, (logp.detach() for logp in logps)))
                        entropy.update(zip(members, (ent.detach() for ent in ents)))
        masks = {i: torch.tensor(s.mask, dtype=torch.float32, device=self.device) for i, s in enumerate(sequences)}
        # The global size of each mini-batch (sequences, trainable tokens): the loss shares' denominators.
        sizes = all_reduce_sum(torch.tensor([[len(mb), sum(float(masks[i].sum()) for i in mb)] for mb in minibatches],
                                            dtype=torch.float64, device=self.device).reshape(-1, 2)).cpu()
        # 2. one optimizer step per mini-batch.
        losses, clips, kls, norms = [], [], [], []
        first_clips, first_dev = [], 0.0  # the first mini-batch is on-policy: ratio 1, nothing clipped
        token_level = self.config.algorithm in ("dapo", "cispo")
        for index, mb in enumerate(minibatches):
            mb_sequences, mb_tokens = sizes[index].tolist()
            for micro in micro_batches([len(sequences[i].ids) for i in mb], config.micro_tokens):
                members = [mb[i] for i in micro]
                filler = self._filler([sequences[i] for i in members])
                if one_pass:
                    with self._rollout_replay(members, sequences, filler):
                        logps, ents = self._logprobs(self.model, members, sequences, filler, with_entropy=True)
                    old_logp.update(zip(members, (logp.detach() for logp in logps)))
                    entropy.update(zip(members, ents))
                    self._reference_logprobs(members, sequences, filler, ref_logp)
                else:
                    context = (self.replay.replay(routes[tuple(members)]) if config.routing_replay
                               else contextlib.nullcontext())
                    with context:
                        logps, _ = self._logprobs(self.model, members, sequences, filler)
                logp_BT = pad(logps)
                old_BT = pad([old_logp[i] for i in members])
                mask_BT = pad([masks[i] for i in members])
                rollout_BT = pad([torch.tensor(sequences[i].rollout_logprobs, dtype=torch.float32,
                                               device=self.device) for i in members], value=math.nan)
                adv_B = torch.tensor([sequences[i].advantage for i in members], dtype=torch.float32,
                                     device=self.device)
                weights = tis_weights(old_BT, rollout_BT, self.loss_config.tis_cap)
                out = self.algorithm.loss(logp_BT, old_BT, adv_B, mask_BT, self.loss_config, weights)
                loss = out.loss
                if ref_logp:
                    kl = (kl_k3(logp_BT, pad([ref_logp[i] for i in members])) * mask_BT).sum() / mask_BT.sum().clamp(min=1)
                    loss = loss + self.loss_config.kl_coef * kl
                    kls.append(float(kl.detach()))
                share = (float(mask_BT.sum()) / max(mb_tokens, 1)) if token_level else len(members) / mb_sequences
                (loss * share).backward()
                losses.append(float(out.loss.detach()) * share)
                clips.append(out.clip_fraction)
                if index == 0:
                    first_clips.append(out.clip_fraction)
                    dev = ((logp_BT.detach() - old_BT).exp() - 1).abs() * mask_BT
                    first_dev = max(first_dev, float(dev.max()) if dev.numel() else 0.0)
            if data_parallel:
                self._all_reduce_grads()
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        gap, known = 0.0, 0
        for i, s in enumerate(sequences):
            rollout = torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=self.device)
            where = masks[i].bool() & torch.isfinite(rollout)
            gap += float((old_logp[i] - rollout)[where].abs().sum())
            known += int(where.sum())
        # Sums over the whole batch (every rank's share under torch.distributed).
        totals = all_reduce_sum(torch.tensor([
            sum(float(m.sum()) for m in masks.values()), sum(float((entropy[i] * masks[i]).sum()) for i in masks),
            gap, known, self.rollout_routed, sum(len(s.ids) for s in sequences)], dtype=torch.float64,
            device=self.device))  # on the device: NCCL reduces CUDA tensors only
        total_tokens, entropy_sum, gap, known, routed, all_tokens = totals.tolist()
        metrics = {"entropy": entropy_sum / max(total_tokens, 1), "logprob_gap": gap / known if known else math.nan}
        if config.update_balancer:
            self.model.update_balancers()
        self.model.eval()
        sums = torch.tensor([sum(losses), sum(clips), len(clips), sum(kls), len(kls)], dtype=torch.float64,
                            device=self.device)
        loss_sum, clip_sum, clip_count, kl_sum, kl_count = all_reduce_sum(sums).tolist()
        metrics.update(loss=loss_sum / len(minibatches), clip_fraction=clip_sum / max(clip_count, 1),
                       grad_norm=sum(norms) / len(norms), trained_tokens=total_tokens,
                       kl_ref=kl_sum / kl_count if kl_count else 0.0,
                       rollout_routed_share=routed / max(all_tokens, 1),
                       first_minibatch_clip_fraction=sum(first_clips) / max(len(first_clips), 1),
                       first_minibatch_ratio_max_dev=first_dev)
        return metrics

