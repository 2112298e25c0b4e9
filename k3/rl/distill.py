"""Multi-teacher distillation: several domain teachers into one student (`k3 distill`).

Modes, at equal student compute (the same prompts, samples per prompt and completion length per step):

    on-policy   (the K3 way) the student samples G completions of each prompt with the engine, which also
                returns the student's logprob of every sampled token; the prompt's domain teacher scores those
                tokens by a packed prefill; each token's advantage is the negative reverse-KL sample
                    A_t = -(log p_student(y_t) - log p_teacher(y_t)),
                optimised with the RL policy-gradient objective of k3.rl.losses (token-level: dapo by
                default), importance-corrected against the sampling logprobs (truncated IS, k3.rl.losses.
                tis_weights), prompt tokens masked out.
    offline     SFT on teacher samples: each domain's teacher samples the completions, the student is trained
                by cross-entropy on them.
    forward-kl  the teacher samples and gives its top-k logprobs at every completion position; the student
                minimises the cross-entropy to that renormalised top-k distribution (forward KL up to the
                teacher's entropy).
    mixed       on-policy, plus ``mixed_weight`` x the top-k forward KL at the student's own sampled positions
                (one teacher scoring pass gives both).

Every ``heldout_every`` steps, per domain, on a fixed held-out prompt set: the exact reverse KL
KL(p_student || p_teacher) summed over the vocabulary at every position of the student's own completions
(fixed seeds), and the held-out loss (NLL) of the reference continuations, next to the teacher's own.

Run directory, as `k3 rl` writes one (so `k3 generate --run DIR` reads it): distill_config.json, config.json,
tokenizer/, checkpoint.pt (atomic: student, optimizer, step, RNG), metrics.jsonl, metrics.png. Resume is
exact: prompts and sampling seeds follow from (seed, step).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from k3.infer.sampling import SamplingParams
from k3.rl.distill_config import DistillConfig  # noqa: F401 (k3.rl.distill's API)
from k3.rl.distill_sources import Item, LocalTeacher, PromptSets, check_shared_tokenizer, load_items, \
    load_model_and_tokenizer, packed_log_softmax, route
from k3.rl.distill_tasks import centred_rewards, load_reward_suite, suite_items, task_reward
from k3.rl.losses import ALGORITHMS, loss_config_for, tis_weights
from k3.rl.policy import micro_batches, packed_logprobs, token_logprobs
from k3.rl.rollout_engine import weights_changed
from k3.rl.routing import RoutingReplay
from k3.runtime import autocast_dtype, resolve_device, seed_everything
from k3.train.loop import Cadence, LoopHooks, TrainingLoop
from k3.train.metrics import figure_grid, metric_series, read_metrics, save_figure
from k3.train.optim import lr_at
from k3.train.run_dir import RunKind, open_run

RUN = RunKind(key="distill", settings_file="distill_config.json", command="k3 distill", what="a distillation run")


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big") % (2 ** 31)


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token advantage -(log p_student(y_t) - log p_teacher(y_t)) [T] from both logprobs of the sampled
    tokens [T]. Its negative mean over tokens drawn from the student estimates KL(student || teacher)."""
    return teacher_logprobs - student_logprobs


def exact_reverse_kl(student_logp_TV: torch.Tensor, teacher_logp_TV: torch.Tensor) -> torch.Tensor:
    """KL(p_s || p_t) = sum_v p_s(v) (log p_s(v) - log p_t(v)) per position: [T, V] log-distributions -> [T]."""
    return (student_logp_TV.exp() * (student_logp_TV - teacher_logp_TV)).sum(-1)


def topk_reverse_kl(student_logp_TV: torch.Tensor, top_ids_TK: torch.Tensor, top_logp_TK: torch.Tensor):
    """Reverse KL(p_s || p_t) over the teacher's top-k ids plus one bucket for every other id, per position
    [T], with the student's gradient. The teacher's top-k logprobs [T, K] are its raw log-softmax values, so the
    bucket holds the rest of its mass. This is the KL between the two distributions coarsened to K + 1 outcomes:
    a lower bound on the full KL, equal to it when K is the vocabulary."""
    student_k = student_logp_TV.gather(1, top_ids_TK)
    term = (student_k.exp() * (student_k - top_logp_TK)).sum(-1)
    if top_ids_TK.shape[1] >= student_logp_TV.shape[1]:
        return term
    outside = torch.ones_like(student_logp_TV, dtype=torch.bool).scatter(1, top_ids_TK, False)
    student_rest = torch.logsumexp(student_logp_TV.masked_fill(~outside, -math.inf), -1)
    teacher_rest = torch.log((1 - top_logp_TK.exp().sum(-1)).clamp(min=1e-8))
    return term + student_rest.exp() * (student_rest - teacher_rest)


def topk_forward_kl(student_logp_TV: torch.Tensor, top_ids_TK: torch.Tensor, top_logp_TK: torch.Tensor):
    """Cross-entropy and KL from the teacher's renormalised top-k distribution to the student, per position:
    (ce [T], kl [T]); ce has the student's gradient, kl = ce - H(teacher top-k) is for reporting."""
    teacher_p = torch.softmax(top_logp_TK, -1)
    ce = -(teacher_p * student_logp_TV.gather(1, top_ids_TK)).sum(-1)
    entropy = -(teacher_p * torch.log_softmax(top_logp_TK, -1)).sum(-1)
    return ce, ce.detach() - entropy


@dataclass
class TokenSequence:
    """One trainable sample: ids [n], start (the prompt length: tokens from start on are trained), and per
    trained token (n - start each): the sampling logprobs (NaN unknown), the advantages, and optionally the
    teacher's top-k ids / logprobs [n - start, k]. kind: "pg" (policy gradient), "sft" or "fkl"."""

    domain: str
    ids: list[int]
    start: int
    kind: str
    rollout_logprobs: list[float] | None = None
    teacher_logprobs: list[float] | None = None
    advantages: list[float] | None = None
    group: int = -1  # the index of its prompt in the step: the G completions of one prompt share it
    task: Any = None  # --rl-suite: the task whose verifier rewards the completion
    reward: float | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def _top_tensors(top: list[list[tuple[int, float]]]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([[t for t, _ in row] for row in top], dtype=torch.long),
            torch.tensor([[v for _, v in row] for row in top], dtype=torch.float32))


class DistillUpdater:
    """One optimizer step over a batch of TokenSequences. The policy-gradient part uses k3.rl.losses' objective
    on the trained tokens laid out one per row (each row a length-1 "sequence" with its own advantage), which is
    the token-mean of the per-token surrogate; the old-policy pass, routing replay, micro-batching and truncated
    importance weights are the RL trainer's (k3.rl.policy)."""

    def __init__(self, model, config: DistillConfig, autocast=None) -> None:
        from k3.train.optim import build_optimizer

        self.model, self.config, self.autocast = model, config, autocast
        loss = config.loss
        self.algorithm = ALGORITHMS[loss.algo]
        self.loss_config = loss_config_for(loss.algo, clip_low=loss.clip_low, clip_high=loss.clip_high,
                                           tis_cap=loss.tis_cap, norm_length=1)  # rows are single tokens
        self.optimizer = build_optimizer(model, config.optim.lr, config.optim.weight_decay)
        self.device = next(model.parameters()).device
        self.replay = RoutingReplay(model)

    def _train_mode(self) -> None:
        self.model.train()
        for _, router in self.model.routers():
            router.eval()  # the Quantile-Balancing bias stays frozen, as in RL

    def _forward(self, members: list[TokenSequence], need_dist: bool):
        ids = torch.tensor([t for s in members for t in s.ids], device=self.device)[None]
        lengths = [len(s.ids) for s in members]
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), device=self.device,
                          dtype=torch.int32)
        with torch.autocast(self.device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            logits = self.model(ids, cu_seqlens=cu).logits[0]
        token_lp, dists = [], []
        for i, s in enumerate(members):
            a, b = int(cu[i]), int(cu[i + 1])
            token_lp.append(token_logprobs(logits[a:b], ids[0, a:b])[s.start:])
            dists.append(torch.log_softmax(logits[a + s.start - 1:b - 1].float(), -1) if need_dist else None)
        return token_lp, dists

    def update(self, sequences: list[TokenSequence]) -> dict[str, float]:
        if not sequences:
            return {}
        config = self.config
        self._train_mode()
        lengths = [len(s.ids) for s in sequences]
        batches = micro_batches(lengths, config.optim.micro_tokens)
        old_logp, routes = {}, {}
        with torch.no_grad():  # the old-policy pass: logprobs of the weights that sampled, experts recorded
            for micro in batches:
                with self.replay.record() as recorded:
                    logps, _ = packed_logprobs(self.model, [sequences[i].ids for i in micro], self.device,
                                               autocast=self.autocast)
                routes[tuple(micro)] = recorded
                old_logp.update({i: lp[sequences[i].start:] for i, lp in zip(micro, logps)})
        counts = {kind: sum(len(s.ids) - s.start for s in sequences if s.kind == kind) for kind in ("pg", "sft", "fkl")}
        sums = {"pg_loss": 0.0, "sft_loss": 0.0, "fkl": 0.0, "rkl": 0.0, "clip": 0.0, "gap": 0.0, "gap_known": 0}
        fkl_weight = config.loss.mixed_weight if config.mode == "mixed" else 1.0
        topk_rkl = config.loss.estimator == "topk"
        for micro in batches:
            members = [sequences[i] for i in micro]
            need_dist = any(s.top_ids is not None for s in members)
            replay = (self.replay.replay(routes[tuple(micro)]) if config.optim.routing_replay
                      else contextlib.nullcontext())
            with replay:
                token_lp, dists = self._forward(members, need_dist)
            loss = torch.zeros((), device=self.device)
            pg = [(i, s, lp) for i, s, lp in zip(micro, members, token_lp) if s.kind == "pg"]
            if pg:
                logp_N = torch.cat([lp for _, _, lp in pg])
                old_N = torch.cat([old_logp[i] for i, _, _ in pg])
                adv_N = torch.tensor([a for _, s, _ in pg for a in s.advantages], device=self.device)
                rollout_N = torch.tensor([v for _, s, _ in pg for v in s.rollout_logprobs], device=self.device)
                weights = tis_weights(old_N[:, None], rollout_N[:, None], self.loss_config.tis_cap)
                ones = torch.ones_like(logp_N)[:, None]
                out = self.algorithm.loss(logp_N[:, None], old_N[:, None], adv_N, ones, self.loss_config, weights)
                share = logp_N.shape[0] / counts["pg"]
                loss = loss + out.loss * share
                sums["pg_loss"] += float(out.loss.detach()) * share
                sums["clip"] += out.clip_fraction * share
                known = torch.isfinite(rollout_N)
                sums["gap"] += float((old_N - rollout_N)[known].abs().sum())
                sums["gap_known"] += int(known.sum())
            for s, lp, dist in zip(members, token_lp, dists):
                if s.kind == "sft":
                    term = -lp.sum() / counts["sft"]
                    loss = loss + term
                    sums["sft_loss"] += float(term.detach())
                if s.top_ids is None:
                    continue
                top_ids, top_logp = s.top_ids.to(self.device), s.top_logprobs.to(self.device)
                if s.kind == "pg" and topk_rkl:
                    rkl = topk_reverse_kl(dist, top_ids, top_logp).sum() / counts["pg"]
                    loss = loss + rkl
                    sums["rkl"] += float(rkl.detach())
                if s.kind == "fkl" or config.mode == "mixed":
                    ce, kl = topk_forward_kl(dist, top_ids, top_logp)
                    denominator = counts["fkl"] if s.kind == "fkl" else counts["pg"]
                    loss = loss + fkl_weight * ce.sum() / denominator
                    sums["fkl"] += float(kl.sum()) / denominator
            loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.optim.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        metrics = {"grad_norm": grad_norm, "trained_tokens": float(sum(counts.values()))}
        if counts["pg"]:
            metrics.update(pg_loss=sums["pg_loss"], clip_fraction=sums["clip"],
                           logprob_gap=sums["gap"] / sums["gap_known"] if sums["gap_known"] else math.nan)
        if counts["sft"]:
            metrics["sft_loss"] = sums["sft_loss"]
        if config.mode in ("forward-kl", "mixed"):
            metrics["topk_forward_kl"] = sums["fkl"]
        if counts["pg"] and topk_rkl:
            metrics["topk_reverse_kl"] = sums["rkl"]
        return metrics


class DistillTrainer:
    """Build with ``DistillTrainer(config)`` (or pass ``student``/``tokenizer``/``teachers`` from Python), then
    ``train()``. ``resume=True`` continues DIR/checkpoint.pt exactly (only ``config.out`` is read from
    ``config``, and ``resume_overrides``, e.g. {"steps": 80}; teachers passed in must be the run's)."""

    def __init__(self, config: DistillConfig, resume: bool = False, log: Callable[[str], None] = print,
                 show_progress: bool = True, student=None, tokenizer=None, teachers: dict | None = None,
                 resume_overrides: dict[str, Any] | None = None) -> None:
        from k3.infer.engine import Engine

        self.log, self.show_progress = log, show_progress
        opened = open_run(RUN, config, resume, DistillConfig.from_dict, **(resume_overrides or {}))
        self.run_dir, state, self.config = opened.directory, opened.state, opened.config
        config, self.out = self.config, self.run_dir.out
        self.device = resolve_device(config.device)
        self.autocast = autocast_dtype("auto", self.device)
        seed_everything(config.seed)
        self.model, self.tokenizer = opened.policy(
            self.device, student, tokenizer, source=config.student, load=load_model_and_tokenizer,
            needs="give the student: --student DIR (a k3 run or a Hugging Face-format directory)")
        if teachers is None:
            if not config.teachers:
                raise ValueError("give at least one teacher: --teacher NAME=DIR (NAME is the domain it teaches)")
            teachers = {name: LocalTeacher.load(name, path, str(self.device), config.sampling.max_context)
                        for name, path in config.teachers.items()}
        self.teachers = teachers
        check_shared_tokenizer(self.tokenizer, {name: t.tokenizer for name, t in teachers.items()})
        missing = sorted(set(config.data) - set(teachers))
        if missing:
            raise ValueError(f"--data for domain(s) {missing} but no --teacher of that name (teachers: "
                             f"{sorted(teachers)})")
        sampling = config.sampling
        items = load_items(config.data, self.tokenizer, sampling.prompt_tokens, sampling.reference_tokens) \
            if config.data else []
        self.reward_weights: dict[str, float] = {}
        fixed_heldout: dict[str, list[Item]] = {}
        for name, weight in config.rl_suites.items():
            suite = load_reward_suite(name, weight, config.suite_tasks, config.heldout.prompts)
            if suite.name not in teachers:
                raise ValueError(f"--rl-suite {name}: its prompts are domain {suite.name!r}, which has no teacher; "
                                 f"give --teacher {suite.name}=DIR (teachers: {sorted(teachers)})")
            train_items, fixed_heldout[suite.name] = suite_items(suite, self.tokenizer)
            items.extend(train_items)
            self.reward_weights[suite.name] = weight
        self.prompts = PromptSets(items, sorted(teachers), config.heldout.prompts, config.seed, fixed_heldout)
        self.model.eval()
        self.updater = DistillUpdater(self.model, config, autocast=self.autocast)
        batch = len(teachers) * config.sampling.prompts_per_domain * config.sampling.samples
        self.engine = Engine(self.model, self.tokenizer, max_context=config.sampling.max_context,
                             max_batch=max(batch, len(teachers) * config.heldout.prompts * config.heldout.samples),
                             prefix_cache=False)
        self.step = self.run_dir.start_or_restore(state, self.updater.optimizer, self.tokenizer, config.to_dict(),
                                                  self.model.config.to_dict())
        self.metrics = self.run_dir.metrics(self.step, resumed=state is not None)
        self._teacher_heldout: dict[str, float] | None = None

    # -- sampling and scoring -------------------------------------------------------------------------------
    def _params(self, seed: int, n: int) -> SamplingParams:
        sampling = self.config.sampling
        return SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, seed=seed,
                              logprobs=0, n=n)

    def _student_samples(self, items: list[Item], seeds: list[int], n: int) -> list[TokenSequence]:
        outs = self.engine.complete([it.prompt for it in items], [self._params(s, n) for s in seeds])
        return [TokenSequence(item.domain, item.prompt + list(c.token_ids), len(item.prompt), "pg",
                              rollout_logprobs=list(c.logprobs), group=index, task=item.task)
                for index, (item, out) in enumerate(zip(items, outs)) for c in out.outputs if c.token_ids]

    def _teacher_samples(self, items: list[Item], seeds: list[int], kind: str) -> list[TokenSequence]:
        out: list[TokenSequence] = []
        for domain, members in route(items).items():
            results = self.teachers[domain].sample([items[i].prompt for i in members],
                                                   [self._params(seeds[i], self.config.sampling.samples)
                                                    for i in members])
            out.extend(TokenSequence(domain, items[i].prompt + list(c.token_ids), len(items[i].prompt), kind)
                       for i, r in zip(members, results) for c in r.outputs if c.token_ids)
        return out

    def _score(self, sequences: list[TokenSequence], top_k: int) -> None:
        """Each sequence's domain teacher scores its trained tokens: advantages, and top-k when asked. A top-k
        of the whole vocabulary takes the teacher's full distributions as tensors (no per-id lists)."""
        for domain, members in route(sequences).items():
            teacher = self.teachers[domain]
            ids, starts = [sequences[i].ids for i in members], [sequences[i].start for i in members]
            full = top_k >= teacher.vocab_size
            if full:
                dists = teacher.log_softmax(ids, starts)
                scored = [(dist.gather(1, torch.tensor(seq[start:])[:, None])[:, 0].tolist(), dist)
                          for seq, start, dist in zip(ids, starts, dists)]
            else:
                scored = [(r.logprobs, r.top_logprobs) for r in teacher.score(ids, starts, top_k=top_k)]
            for i, (logprobs, top) in zip(members, scored):
                s = sequences[i]
                s.teacher_logprobs = list(logprobs)
                if s.kind == "pg":
                    dense = reverse_kl_advantages(torch.tensor(s.rollout_logprobs), torch.tensor(logprobs))
                    # topk: the reverse KL is a loss of its own; the policy-gradient advantage is the task reward only
                    sampled = self.config.loss.estimator == "sampled"
                    s.advantages = (dense if sampled else torch.zeros_like(dense)).tolist()
                if full:
                    s.top_ids = torch.arange(top.shape[1]).expand(top.shape[0], -1)
                    s.top_logprobs = top
                elif top_k:
                    s.top_ids, s.top_logprobs = _top_tensors(top)

    @staticmethod
    def _subtract_baseline(sequences: list[TokenSequence]) -> None:
        """A_t -= mean of A over the batch's sampled tokens. A constant baseline leaves the expected gradient as
        it is (E[grad log p] = 0) and removes the part of each token's push that is only the mean reverse KL;
        nothing is divided by a spread, so the dense per-token signal keeps its scale."""
        values = [a for s in sequences if s.kind == "pg" for a in s.advantages]
        if values:
            mean = sum(values) / len(values)
            for s in sequences:
                if s.kind == "pg":
                    s.advantages = [a - mean for a in s.advantages]

    def _rewards(self, sequences: list[TokenSequence]) -> None:
        for s in sequences:
            if s.task is not None:
                s.reward = task_reward(s.task, s.ids[s.start:], self.tokenizer)

    def _add_task_rewards(self, sequences: list[TokenSequence]) -> None:
        """advantage += weight x (reward - its group's mean reward) on every token of a rewarded completion."""
        chosen = [s for s in sequences if s.reward is not None]
        for s, centred in zip(chosen, centred_rewards([s.reward for s in chosen], [s.group for s in chosen])):
            bonus = self.reward_weights[s.domain] * centred
            s.advantages = [a + bonus for a in s.advantages]

    # -- one step -------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        config = self.config
        self.step += 1
        started = time.perf_counter()
        items = self.prompts.for_step(self.step, config.sampling.prompts_per_domain)
        seeds = [_seed(config.seed, self.step, i) for i in range(len(items))]
        t0 = time.perf_counter()
        if config.on_policy:
            sequences = self._student_samples(items, seeds, config.sampling.samples)
        else:
            sequences = self._teacher_samples(items, seeds, "sft" if config.mode == "offline" else "fkl")
        sample_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if config.mode != "offline":
            self._score(sequences, config.loss.top_k if config.uses_top_k else 0)
        score_s = time.perf_counter() - t0
        if config.on_policy and config.loss.baseline and config.loss.estimator == "sampled":
            self._subtract_baseline(sequences)
        if config.on_policy:
            self._rewards(sequences)
            self._add_task_rewards(sequences)
        sampled = sum(len(s.ids) - s.start for s in sequences)
        record: dict[str, Any] = {"step": self.step}
        if config.on_policy:
            for domain, members in route(sequences).items():
                values = [s - t for i in members for s, t in zip(sequences[i].rollout_logprobs,
                                                                 sequences[i].teacher_logprobs)]
                record[f"train_rkl/{domain}"] = sum(values) / max(len(values), 1)
                rewards = [sequences[i].reward for i in members if sequences[i].reward is not None]
                if rewards:
                    record[f"train_reward/{domain}"] = sum(rewards) / len(rewards)
        t0 = time.perf_counter()
        optim = config.optim
        lr = optim.lr if optim.lr_schedule == "constant" else lr_at(self.step - 1, config.steps, optim.lr, 0)
        for group in self.updater.optimizer.param_groups:
            group["lr"] = lr
        record.update(self.updater.update(sequences), lr=lr)
        weights_changed(self.engine)
        train_s = time.perf_counter() - t0
        record.update(sampled_tokens=sampled, sample_s=sample_s, train_s=train_s,
                      sample_tokens_per_s=sampled / sample_s if sample_s > 0 else 0.0,
                      step_s=time.perf_counter() - started)
        if config.mode != "offline":  # offline SFT asks the teacher for samples only
            record.update(score_s=score_s, score_tokens_per_s=sum(len(s.ids) for s in sequences) / max(score_s, 1e-9))
        return record

    # -- held-out metrics -----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Per domain: exact reverse KL to its teacher on the student's own completions of the held-out prompts
        (fixed seeds), and the held-out NLL of the reference continuations for student and teacher (for an
        --rl-suite domain, which has no reference text, the mean task reward of those completions instead)."""
        config = self.config
        out: dict[str, float] = {}
        for domain in self.prompts.domains:
            items = self.prompts.heldout[domain]
            seeds = [_seed(config.seed, "heldout", domain, i) for i in range(len(items))]
            samples = self._student_samples(items, seeds, config.heldout.samples)
            if samples:
                ids, starts = [s.ids for s in samples], [s.start for s in samples]
                student = packed_log_softmax(self.model, ids, starts, self.device)
                teacher = self.teachers[domain].log_softmax(ids, starts)
                kls = torch.cat([exact_reverse_kl(a, b.to(a.device)) for a, b in zip(student, teacher)])
                out[f"heldout_rkl/{domain}"] = float(kls.mean())
            if domain not in self.reward_weights:  # a suite's prompts have no reference text
                out[f"heldout_nll/{domain}"] = self._nll(domain, items, student=True)
            else:
                self._rewards(samples)
                out[f"heldout_pass/{domain}"] = sum(s.reward for s in samples) / max(len(samples), 1)
        if self._teacher_heldout is None:
            self._teacher_heldout = {f"teacher_heldout_nll/{d}": self._nll(d, self.prompts.heldout[d], student=False)
                                     for d in self.prompts.domains if d not in self.reward_weights}
            for domain in self.reward_weights:
                self._teacher_heldout[f"teacher_heldout_pass/{domain}"] = self._teacher_pass(domain)
        out.update(self._teacher_heldout)
        return out

    def _teacher_pass(self, domain: str) -> float:
        """The domain's teacher's mean reward on the held-out tasks, sampled as the student's are."""
        items = self.prompts.heldout[domain]
        seeds = [_seed(self.config.seed, "heldout", domain, i) for i in range(len(items))]
        params = [self._params(seed, self.config.heldout.samples) for seed in seeds]
        results = self.teachers[domain].sample([it.prompt for it in items], params)
        rewards = [task_reward(it.task, list(c.token_ids), self.tokenizer)
                   for it, r in zip(items, results) for c in r.outputs]
        return sum(rewards) / max(len(rewards), 1)

    def _nll(self, domain: str, items: list[Item], student: bool) -> float:
        chosen = [it for it in items if it.reference and it.prompt]
        if not chosen:
            return math.nan
        ids, starts = [it.prompt + it.reference for it in chosen], [len(it.prompt) for it in chosen]
        if student:
            logps, _ = packed_logprobs(self.model, ids, self.device)
            values = torch.cat([lp[s:] for lp, s in zip(logps, starts)])
        else:
            values = torch.tensor([v for r in self.teachers[domain].score(ids, starts) for v in r.logprobs])
        return float(-values.mean())

    # -- run ------------------------------------------------------------------------------------------------
    def save(self) -> None:
        self.run_dir.save(self.model.state_dict(), self.updater.optimizer.state_dict(), self.model.config.to_dict(),
                          self.config.to_dict(), self.step)

    def plot(self) -> None:
        plot_distill_metrics(self.out / "metrics.jsonl", self.out / "metrics.png")

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        """Run to ``steps`` (or stop after step ``stop_at``, as an interrupted run would)."""
        config = self.config
        loop = TrainingLoop(Cadence(config.steps, config.save_every, eval_every=config.heldout.every),
                            LoopHooks(step=self.train_step, position=lambda: self.step, save=self.save,
                                      evaluate=self.evaluate, plot=self.plot),
                            metrics=self.metrics, desc=f"distill {config.mode}", show_progress=self.show_progress,
                            log=self.log, time_budget_s=config.time_budget_s)
        result = loop.run(stop_at)
        summary: dict[str, Any] = {"start_step": result.start_step, "stopped": result.stopped}
        if result.first_eval is not None:
            summary["first"] = result.first_eval
        if result.last_eval is not None:
            summary["last"] = result.last_eval  # every key of evaluate's is heldout_* or teacher_*
        summary["steps"] = result.steps
        return summary


def plot_distill_metrics(metrics_path, png_path) -> None:
    """Per-domain held-out reverse KL and NLL (teacher's as dashed lines), training reverse KL, losses."""
    records = read_metrics(metrics_path)
    keys = sorted({k for r in records for k in r if isinstance(r.get(k), (int, float))})
    fig, axes = figure_grid()
    panels = [(axes[0][0], "heldout_rkl/", "held-out reverse KL to the domain's teacher"),
              (axes[0][1], "heldout_nll/", "held-out NLL (dashed: teacher)"),
              (axes[1][0], "train_rkl/", "training reverse KL (sampled tokens)"),
              (axes[1][1], ("pg_loss", "sft_loss", "topk_forward_kl", "grad_norm"), "update")]
    for ax, prefix, title in panels:
        chosen = [k for k in keys if (k.startswith(prefix) if isinstance(prefix, str) else k in prefix)]
        for key in chosen:
            xs, ys = metric_series(records, key)
            ax.plot(xs, ys, "o-" if key.startswith("heldout") else "-", label=key, linewidth=1)
            if key.startswith("heldout_nll/"):
                txs, tys = metric_series(records, "teacher_" + key)
                if txs:
                    ax.plot(txs, tys, "--", label="teacher_" + key, linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        if chosen:
            ax.legend(fontsize=7)
    save_figure(fig, png_path)
