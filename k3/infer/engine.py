"""The inference engine: one loop that `k3 generate`, `k3 chat`, `k3 serve`, evaluation and RL rollouts share.

    engine = Engine(model, tokenizer, max_context=4096, max_batch=32)
    outs = engine.complete([ids_a, ids_b], SamplingParams(max_new_tokens=64, temperature=0, logprobs=0))

Requests join the running batch at step boundaries and leave when they finish (stop token, stop string,
max tokens, context, abort). Each `step()` runs the scheduler's plan (decodes first, then prefill chunks
within a token budget) through the runner, samples every row on the device with its own parameters, and
returns the new tokens as events. Memory is a `CachePool` (KDA state slots + paged MLA latents) with exact
prefix caching; see scheduler.py and prefix_cache.py for the rules.

Exactness: greedy output of a request does not depend on what else runs (prompts are cut into the same
chunks whatever the load, decode rows never mix, MoE routing in eval mode is per token); the tests check it
against a recompute-everything reference.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch

from k3.infer.cache_pool import CachePool
from k3.infer.detokenize import TextAssembler
from k3.infer.engine_config import (EngineConfig, default_prefill_chunk, fit_prefill_to_memory,  # noqa: F401
                                    long_prefill_chunk, plan_engine)
from k3.kernels import applied as kernels_applied
from k3.infer.prefix_cache import PrefixCache
from k3.infer.runner import ModelRunner
from k3.infer.sampling import SamplingParams, row_values, sample_rows
from k3.infer.scheduler import (DECODE, FINISHED, PREFILL, Request, Scheduler, Sequence, pages_for,
                                prefill_forwards)


# The warm-up's forward of many rows (Engine.warmup): how many, and how long each prompt.
WARM_ROWS, WARM_ROW_TOKENS = 16, 32


@dataclass
class TokenEvent:
    """One new token of one sample (finished events carry the reason; an abort event has token_id None)."""

    request_id: str
    index: int
    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read (overlap_steps): the rows, their params, the
    device results and their host copies, readable once `copied` has passed."""

    rows: list
    params: list
    sampled: object  # SampledBatch on the device (the next step gathers its tokens from here)
    host: object  # SampledBatch of host copies
    copied: object  # torch.cuda.Event, or None where the copies were synchronous

    @classmethod
    def launch(cls, rows, params, sampled) -> "_InFlight":
        if sampled.tokens.device.type != "cuda":
            return cls(rows, params, sampled, sampled, None)
        host = type(sampled)(*(None if t is None else t.to("cpu", non_blocking=True)
                               for t in (sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs)))
        copied = torch.cuda.Event()
        copied.record()
        return cls(rows, params, sampled, host, copied)

    def read(self):
        if self.copied is not None:
            self.copied.synchronize()
        return self.host


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With Engine(record_routing=True): the experts each fed token was routed to, [MoE layers, tokens, K]
    # for the prompt and every generated token but the last (which was never fed), for routing replay.
    routing: torch.Tensor | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)


@dataclass
class ScoreOutput:
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None



def check_prompt_fields(ids: list[int], params: SamplingParams, name: str, max_context: int, vocab_size: int,
                        max_batch: int) -> None:
    """The checks of a prompt that need only the engine's sizes (the engine and its process front both run them)."""
    if not ids:
        raise ValueError(f"{name} is empty after tokenization; give at least one token")
    if len(ids) >= max_context:
        raise ValueError(f"{name} has {len(ids)} tokens but the context allows {max_context} (prompt "
                         f"plus at least one new token); shorten it or raise max_context")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{name} holds token ids outside [0, {vocab_size}); the tokenizer does not match the model")
    if params.n > max_batch:
        raise ValueError(f"n={params.n} samples cannot run at once with max_batch={max_batch}")


class Engine:
    """model: K3ForCausalLM (put in eval mode here); tokenizer: the project's tokenizer interface or None.

    config: the engine's settings (k3.infer.engine_config.EngineConfig: max_context, max_batch, page_size,
    prefill_chunk, max_step_tokens, prefill_padding, prefix_cache, prefix_slots, num_pages, dtype, use_cuda_graphs,
    record_routing, fuse_weights); keyword options are its fields, replacing config's:
    Engine(model, tok, max_context=512). What the settings leave open is decided by engine_config.plan_engine, in one place; self.plan holds the result.
    kernels: k3.kernels choices held while the engine works (setup, steps, scoring), e.g. {"moe": "torch"}."""

    @kernels_applied
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *,
                 kernels: dict[str, str] | None = None, **options) -> None:
        config = dataclasses.replace(config or EngineConfig(), **options)
        plan = plan_engine(config, model)
        self.engine_config = config
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.max_context, self.max_batch = config.max_context, config.max_batch
        self.device = next(model.parameters()).device
        self.pool = CachePool(self.config, config.max_batch + plan.prefix_slots, plan.num_pages, config.page_size,
                              self.device, plan.dtype)
        self.plan = plan = fit_prefill_to_memory(plan, config, model)
        self.batch_tokens, self.prefill_fit = plan.batch_tokens, plan.prefill_fit
        self.prefix_cache = PrefixCache(self.pool, plan.prefix_slots) if plan.prefix_slots > 0 else None
        self.scheduler = Scheduler(self.pool, self.prefix_cache, config.max_batch, config.max_context,
                                   plan.prefill_chunk, plan.max_step_tokens, gather_s=config.gather_prompts_ms / 1e3)
        if plan.fuse_weights:
            from k3.layers.fused_weights import fuse_model_weights

            fuse_model_weights(model)
        record_routing = config.record_routing
        # K3_COMPILE_DECODE=1 compiles the decode step (k3.infer.runner); recording routes runs Python hooks in
        # every forward, which a compiled graph would not run.
        self.runner = ModelRunner(self.model, self.pool, plan.max_pages, plan.use_cuda_graphs,
                                  compile_decode=False if record_routing else None)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.record_routing = record_routing
        self._routes: list[list[torch.Tensor]] | None = None  # filled by the router hooks during a step's forward
        if record_routing:
            for index, (_, router) in enumerate(model.routers()):
                router.register_forward_hook(self._route_hook(index))
            self._num_moe = len(model.routers())
        # steps: every step; prefill_forwards: the prefill forwards inside them (several prompts may share one);
        # overlapped_steps: decode steps launched before the previous one was read (overlap_steps).
        self.stats_counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "finished": 0,
                               "prefill_forwards": 0, "overlapped_steps": 0}
        self.overlap_steps = plan.overlap_steps
        self._in_flight: _InFlight | None = None  # overlap_steps: the launched step whose tokens are unread
        # Callables (rows, logits [B, V]) -> logits run before sampling, in order (tests force outputs with one).
        self.logits_processors: list = []

    # --- requests -----------------------------------------------------------------------------------
    def stop_ids(self, params: SamplingParams) -> set[int]:
        stops = set(params.stop_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            stops.add(self.tokenizer.eos_token_id)
        return stops

    def check_prompt(self, ids: list[int], params: SamplingParams, name: str = "the prompt") -> None:
        """Raise ValueError, saying what is wrong, for a prompt the engine cannot run."""
        check_prompt_fields(ids, params, name, self.max_context, self.config.vocab_size, self.max_batch)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine to have a tokenizer")
        size = self.pool.page_size
        total = pages_for(min(len(ids) + params.max_new_tokens, self.max_context), size)
        need = total + (params.n - 1) * (total - len(ids) // size)
        if need > self.pool.num_pages or params.n > self.pool.num_slots:
            raise ValueError(f"{name} needs {need} MLA pages but the pool has {self.pool.num_pages}; lower "
                             f"max_new_tokens or n, or give the engine more pages")

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_embeds: torch.Tensor | None = None) -> str:
        """prompt_embeds [len(prompt), D]: input embeddings to prefill with instead of the ids' (a multimodal
        prompt: K3ForConditionalGeneration.embed_multimodal puts the image embeddings at the placeholders)."""
        prompt = [int(t) for t in prompt]
        self.check_prompt(prompt, params)
        if prompt_embeds is not None:
            expected = (len(prompt), self.config.hidden_size)
            if tuple(prompt_embeds.shape) != expected:
                raise ValueError(f"prompt_embeds must be [prompt tokens, hidden] = {list(expected)}, got "
                                 f"{list(prompt_embeds.shape)}")
            prompt_embeds = prompt_embeds.detach().to(self.device)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt, params, prompt_embeds=prompt_embeds,
                          stop_ids=frozenset(self.stop_ids(params)))
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its slot and pages. False when it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        for seq in request.sequences:
            if seq.status != FINISHED:
                seq.status, seq.finish_reason = FINISHED, "abort"
                self.scheduler.release(seq)
        self.scheduler.release_reserved(request)
        if request in self.scheduler.running:
            self.scheduler.running.remove(request)
        return True

    def gather_wait_s(self) -> float:
        """How long a caller's loop may sleep instead of stepping: new prompts wait for others arriving with them
        (EngineConfig.gather_prompts_ms) and nothing else runs. 0: step on."""
        until = self.scheduler.gathering_until
        if until is None or self._in_flight is not None or any(
                s.status == DECODE for s in self.scheduler.running_sequences()):
            return 0.0
        return max(0.0, until - self.scheduler.clock())

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running) or self._in_flight is not None

    # --- routing capture ----------------------------------------------------------------------------
    def _route_hook(self, index: int):
        def hook(module, args, output) -> None:
            if self._routes is not None:
                self._routes[index].append(output.topk_ids_TK.detach())
        return hook

    def _capture(self, seqs: list[Sequence], run, lengths: list[int] | None = None):
        """Run a forward; with record_routing, append each row's expert ids ([T, K] per MoE layer) to it (its
        first lengths[row] tokens': the rest is a padded prefill's padding)."""
        if not self.record_routing:
            return run()
        self._routes = [[] for _ in range(self._num_moe)]
        try:
            out = run()
            for layer, calls in enumerate(self._routes):
                ids = torch.cat(calls).view(len(seqs), -1, calls[0].shape[-1]).cpu()
                for row, seq in enumerate(seqs):
                    if seq.routing is None:
                        seq.routing = [[] for _ in range(self._num_moe)]
                    seq.routing[layer].append(ids[row] if lengths is None else ids[row, :lengths[row]])
        finally:
            self._routes = None
        return out

    # --- the step -----------------------------------------------------------------------------------
    @kernels_applied
    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Run one step -> the token events it produced. With overlap_steps, a decode-only step is launched before
        the previous step's tokens are read, and returns those (one step late); any other step reads the step in
        flight first."""
        if self.overlap_steps:
            return self._step_overlapped()
        return self._step()

    def _step(self) -> list[TokenEvent]:
        plan = self.scheduler.plan()
        if not plan.decodes and not plan.prefills:  # new prompts gathering (Scheduler gather_s): nothing to run yet
            return []
        rows: list[Sequence] = []
        logits = []
        if plan.decodes:
            logits.append(self._capture(plan.decodes, lambda: self.runner.decode(plan.decodes)))
            for seq in plan.decodes:
                seq.num_cached += 1
            rows.extend(plan.decodes)
        for forward in prefill_forwards(plan.prefills, self.pool.page_size, self.scheduler.max_step_tokens,
                                        self.engine_config.prefill_padding):
            seqs = forward.seqs
            self.stats_counters["prefill_forwards"] += 1
            snapshots = [self._snapshot_slot(seq, start, end) for seq, start, end in zip(seqs, forward.starts,
                                                                                          forward.ends)]
            try:
                last_rows = self._capture(
                    seqs, lambda: self.runner.prefill(seqs, forward.starts, forward.ends, snapshots),
                    [end - start for start, end in zip(forward.starts, forward.ends)])
            except BaseException:
                for snapshot in filter(None, snapshots):
                    self.pool.free_slot(snapshot[1])
                raise
            for seq, last, start, end, snapshot in zip(seqs, last_rows, forward.starts, forward.ends, snapshots):
                seq.num_cached = end
                self.stats_counters["prompt_tokens"] += end - start
                if snapshot is not None:
                    self.prefix_cache.adopt(seq.tokens, snapshot[0], seq.pages, snapshot[1],
                                            shared=snapshot[0] == seq.shared_at)
                if self.prefix_cache is not None and end in seq.register_at:
                    self.prefix_cache.insert(seq.tokens, end, seq.pages, seq.slot, shared=end == seq.shared_at)
                if end == seq.prompt_len:
                    seq.status = DECODE
                    request = self.requests[seq.request_id]
                    group = [seq] + (self.scheduler.fork(request) if request.params.n > 1 else [])
                    logits.append(last[None].expand(len(group), -1))
                    rows.extend(group)
        self.stats_counters["steps"] += 1
        if not rows:
            return []
        params, sampled = self._sample_launch(rows, torch.cat(logits))
        events = self._book(rows, params, sampled)
        self._retire()
        return events

    def _retire(self) -> None:
        for request in self.scheduler.remove_finished():
            self.requests.pop(request.request_id, None)
            self.stats_counters["finished"] += 1

    # --- overlapped steps (overlap_steps) -----------------------------------------------------------
    def _overlappable(self, plan) -> bool:
        """Decode rows only, whose next step needs nothing of this one's tokens on the host (a grammar's mask and
        penalty counts do), and no per-forward hooks."""
        return (bool(plan.decodes) and not plan.prefills and not self.record_routing and not self.logits_processors
                and all(s.params.grammar is None and not s.params.penalised for s in plan.decodes))

    def _step_overlapped(self) -> list[TokenEvent]:
        flight = self._in_flight
        plan = self.scheduler.plan()
        if not self._overlappable(plan):
            # Landing may finish rows of this plan: the plain step plans again after it.
            return self._land() + self._step()
        rows = plan.decodes
        tokens = None
        if flight is not None:
            # Rows of the step in flight take their input from its sampled tokens, still on the device. Rows that
            # finish there (unknown until it is read) run this step too; their results are dropped when it lands,
            # and their slot and pages are reused only by later launches on the same stream.
            where = {id(seq): i for i, seq in enumerate(flight.rows)}
            pairs = [(row, where[id(seq)]) for row, seq in enumerate(rows) if id(seq) in where]
            if pairs:
                index = row_values(pairs, self.device)  # [k, 2] int64: this step's row, the flight's row
                tokens = (index[:, 0], flight.sampled.tokens[index[:, 1]])
        logits = self.runner.decode(rows, tokens)
        for seq in rows:
            seq.num_cached += 1
        self.stats_counters["steps"] += 1
        self.stats_counters["overlapped_steps"] += 1
        params, sampled = self._sample_launch(rows, logits)
        launched = _InFlight.launch(rows, params, sampled)  # its copies queue right behind its sampling
        events = self._land()
        self._in_flight = launched
        return events

    def _land(self) -> list[TokenEvent]:
        """Read the step in flight (waiting for its copies), book its tokens -> their events ([] if none)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        events = self._book(flight.rows, flight.params, flight.read())
        self._retire()
        return events

    def _snapshot_slot(self, seq: Sequence, start: int, end: int) -> tuple[int, int] | None:
        """(boundary, slot) where this chunk runs through a prefix-cache boundary of its prompt that no entry saves
        yet: the forward saves the KDA state there into the slot (reserved now, an entry's after the forward).
        None otherwise, or when the cache has no slot to spare."""
        inside = [b for b in seq.register_at if start < b < end]
        if not inside or self.prefix_cache.holds(seq.tokens, inside[0]):
            return None
        slot = self.prefix_cache.reserve_slot()
        return None if slot is None else (inside[0], slot)

    def _constrain(self, rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Rows under a grammar keep only the tokens their matcher allows (one mask for all of them, applied
        on the device); the other rows are untouched."""
        for processor in self.logits_processors:
            logits = processor(rows, logits)
        index = [row for row, seq in enumerate(rows) if seq.params.grammar is not None]
        if not index:
            return logits
        from k3.infer.structured import allowed_rows

        for row in index:
            if rows[row].matcher is None:
                rows[row].matcher = rows[row].params.grammar.matcher()
        allowed = allowed_rows([rows[row].matcher for row in index], logits.shape[-1], logits.device)
        logits = logits.clone()
        picked = torch.tensor(index, device=logits.device)
        logits[picked] = logits[picked].masked_fill(~allowed, float("-inf"))
        return logits

    def _sample_launch(self, rows: list[Sequence], logits: torch.Tensor):
        """Sample each row's next token on the device -> (the rows' params, SampledBatch); nothing read back."""
        logits = self._constrain(rows, logits)
        vocab = logits.shape[-1]
        # One pass over the rows gathers what sample_rows takes (it runs once per row per step, so at large
        # batches the separate list comprehensions and repeated property reads added up).
        params = [seq.params for seq in rows]
        generators: list[torch.Generator | None] = []
        counts: list[tuple[torch.Tensor | None, torch.Tensor] | None] = []
        want, top_n = False, 0
        for seq, p in zip(rows, params):
            if p.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=self.device).manual_seed((p.seed + seq.index) % 2**64)
            generators.append(seq.generator)
            if p.penalised:
                if seq.output_counts is None:
                    seq.output_counts = torch.zeros(vocab, dtype=torch.long, device=self.device)
                    seq.prompt_counts = torch.bincount(torch.tensor(seq.tokens[: seq.prompt_len],
                                                                    device=self.device), minlength=vocab)
                counts.append((seq.prompt_counts, seq.output_counts))
            else:
                counts.append(None)
            if p.logprobs is not None:
                want, top_n = True, max(top_n, p.logprobs)
        return params, sample_rows(logits, params, generators, counts, want_logprobs=want, top_n=top_n)

    def _book(self, rows: list[Sequence], params: list[SamplingParams], sampled) -> list[TokenEvent]:
        """Append each row's sampled token (SampledBatch, read back here) -> the token events; rows finished
        meanwhile (a step in flight: by an earlier token, or aborted) are skipped."""
        tokens = sampled.tokens.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        now = time.monotonic()
        events = []
        booked = 0
        for row, (seq, p, token) in enumerate(zip(rows, params, tokens)):
            if seq.status == FINISHED:
                continue
            booked += 1
            seq.tokens.append(token)
            seq.first_token_time = seq.first_token_time or now
            if seq.output_counts is not None:
                seq.output_counts[token] += 1
            if seq.matcher is not None:
                seq.matcher.advance(token)
            event = TokenEvent(seq.request_id, seq.index, token)
            k = p.logprobs
            if k is not None:
                event.logprob = logprobs[row]
                seq.logprobs.append(event.logprob)
                if k > 0:
                    event.top_logprobs = list(zip(top_ids[row][:k], top_values[row][:k]))
                    seq.top_logprobs.append(event.top_logprobs)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.status, seq.finish_reason = FINISHED, reason
                event.finished, event.finish_reason = True, reason
                self.scheduler.release(seq)
            events.append(event)
        self.stats_counters["generated_tokens"] += booked
        return events

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop and self._hits_stop_string(seq, token):
            return "stop"
        if seq.matcher is not None and seq.matcher.stopped:  # the grammar is complete
            return "stop"
        if len(seq.tokens) - seq.prompt_len >= seq.params.max_new_tokens or len(seq.tokens) >= self.max_context:
            return "length"
        return None

    def _hits_stop_string(self, seq: Sequence, token: int) -> bool:
        # The text grows by what each token adds (k3.infer.detokenize), so a step costs O(its text), not
        # O(everything generated): decoding the whole output every step made long outputs quadratic.
        if seq.stop_text is None:
            seq.stop_text = TextAssembler(self.tokenizer, seq.params.stop)
        seq.stop_text.push(token)
        return seq.stop_text.stopped

    # --- whole-batch helpers ------------------------------------------------------------------------
    def run_until_done(self, request_ids: list[str], progress=None) -> dict[str, list[Sequence]]:
        """Step until every given request has finished -> its sequences by sample index. progress: a tqdm bar
        advanced by finished requests."""
        pending = {rid: self.requests[rid] for rid in request_ids}
        done = 0
        while any(not r.finished for r in pending.values()):
            if not self.has_unfinished():
                raise RuntimeError("the engine stopped with requests still unfinished")
            self.step()
            if progress is not None:
                now = sum(r.finished for r in pending.values())
                progress.update(now - done)
                done = now
        return {rid: sorted(r.sequences, key=lambda s: s.index) for rid, r in pending.items()}

    def text_of(self, tokens: list[int], params: SamplingParams) -> str | None:
        """Generated tokens as text: stop tokens dropped, cut before the first stop string."""
        if self.tokenizer is None:
            return None
        stops = self.stop_ids(params)
        text = self.tokenizer.decode([t for t in tokens if t not in stops])
        for stop in params.stop:
            if stop in text:
                text = text[: text.index(stop)]
        return text

    def complete(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False, prompt_embeds: list[torch.Tensor | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to the end through continuous batching; one RequestOutput per prompt, in order.
        prompt_embeds: per prompt, input embeddings [len, D] or None (see add_request)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        for i, (ids, p) in enumerate(zip(prompts, params_list)):
            self.check_prompt(list(ids), p, name=f"prompt {i}")
        embeds = prompt_embeds or [None] * len(prompts)
        ids = [self.add_request(list(p), sp, prompt_embeds=e) for p, sp, e in zip(prompts, params_list, embeds)]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="generate", unit="req")
        finished = self.run_until_done(ids, progress)
        if progress is not None:
            progress.close()
        outputs = []
        for rid in ids:
            out = RequestOutput(rid, finished[rid][0].tokens[: finished[rid][0].prompt_len])
            for seq in finished[rid]:
                want = seq.params.logprobs is not None
                routing = None
                if seq.routing is not None:
                    routing = torch.stack([torch.cat(calls) for calls in seq.routing])
                out.outputs.append(Completion(seq.index, seq.generated, self.text_of(seq.generated, seq.params),
                                              seq.finish_reason, seq.logprobs if want else None,
                                              seq.top_logprobs if want and seq.params.logprobs else None, routing))
            outputs.append(out)
        return outputs

    def generate_ids(self, prompts: list[list[int]], params: SamplingParams,
                     on_token=None) -> list[list[int]]:
        """prompts: token id lists -> the new tokens of each (a stop token that ended it included).
        on_token(prompt index, token id) is called as tokens arrive."""
        if params.n != 1:
            raise ValueError("generate_ids returns one sequence per prompt; use complete() for n > 1")
        for i, ids in enumerate(prompts):
            self.check_prompt(list(ids), params, name=f"prompt {i}")
        if params.max_new_tokens == 0:
            return [[] for _ in prompts]
        index = {self.add_request(list(p), params): i for i, p in enumerate(prompts)}
        outputs: list[list[int]] = [[] for _ in prompts]
        while any(rid in self.requests for rid in index):
            for event in self.step():
                if event.request_id in index and event.token_id is not None:
                    outputs[index[event.request_id]].append(event.token_id)
                    if on_token is not None:
                        on_token(index[event.request_id], event.token_id)
        return outputs

    def generate(self, prompts: list[str], params: SamplingParams, on_token=None) -> list[str]:
        """Text in, generated text out (stop tokens and stop strings removed)."""
        if self.tokenizer is None:
            raise ValueError("generate() needs a tokenizer; use generate_ids() with token ids")
        ids = [self.tokenizer.encode(p) for p in prompts]
        return [self.text_of(out, params) for out in self.generate_ids(ids, params, on_token)]

    # --- scoring ------------------------------------------------------------------------------------
    @kernels_applied
    @torch.no_grad()
    def score(self, sequences: list[list[int]], starts: list[int], top_k: int = 0,
              max_tokens_per_forward: int | None = None) -> list[ScoreOutput]:
        """log p(seq[t] | seq[:t]) for t in [starts[i], len) of every sequence, by packed prefill (documents
        never see each other), several sequences per forward up to a token budget."""
        if len(sequences) != len(starts):
            raise ValueError(f"got {len(sequences)} sequences but {len(starts)} starts")
        for i, (seq, start) in enumerate(zip(sequences, starts)):
            if not 1 <= start <= len(seq):
                raise ValueError(f"starts[{i}]={start} must be in [1, {len(seq)}] (the first token has no "
                                 f"prediction)")
            if len(seq) > self.max_context:
                raise ValueError(f"sequence {i} has {len(seq)} tokens but the context allows {self.max_context}")
        # A sequence longer than one forward's budget is scored alone, in chunks through a recurrent cache
        # (KDA state carried, MLA latents appended), so activation memory stays that of one chunk at any length.
        budget = max_tokens_per_forward or self.batch_tokens
        results: list[ScoreOutput | None] = [None] * len(sequences)
        batch: list[int] = []
        for i in sorted(range(len(sequences)), key=lambda j: len(sequences[j])):
            if len(sequences[i]) > budget:
                self._score_chunked(sequences[i], starts[i], top_k, budget, results, i)
                continue
            if batch and sum(len(sequences[j]) for j in batch) + len(sequences[i]) > budget:
                self._score_packed(sequences, starts, batch, top_k, results)
                batch = []
            batch.append(i)
        if batch:
            self._score_packed(sequences, starts, batch, top_k, results)
        return results  # type: ignore[return-value]

    def _score_packed(self, sequences, starts, batch, top_k, results, head_rows: int = 4096) -> None:
        """One packed forward to the final hidden states, then the head over the scored rows of each sequence."""
        from k3.model import PackedDocs

        ids = torch.tensor([[t for j in batch for t in sequences[j]]], device=self.device)
        lengths = [len(sequences[j]) for j in batch]
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), device=self.device)
        hidden = self.model.model(ids, None, PackedDocs.from_cu_seqlens(cu, ids.shape[1]))[0]  # [T, D]
        offset = 0
        for j, length in zip(batch, lengths):
            picked: list[float] = []
            top: list | None = [] if top_k > 0 else None
            self._score_rows(hidden[offset:offset + length], sequences[j], 0, starts[j] - 1, length - 1, top_k,
                             picked, top, head_rows)
            results[j] = ScoreOutput(picked, top)
            offset += length

    def _score_chunked(self, seq, start, top_k, chunk, results, j) -> None:
        """One long sequence in forwards of at most ``chunk`` tokens through a HybridCache."""
        cache = self.model.new_cache(1)
        ids = torch.tensor([seq], device=self.device)
        picked: list[float] = []
        top: list | None = [] if top_k > 0 else None
        for a in range(0, len(seq), chunk):
            b = min(a + chunk, len(seq))
            hidden = self.model.model(ids[:, a:b], cache)[0]
            cache.seen_tokens += b - a
            lo, hi = max(a, start - 1), min(b, len(seq) - 1)
            if lo < hi:
                self._score_rows(hidden, seq, a, lo, hi, top_k, picked, top)
        results[j] = ScoreOutput(picked, top)

    def _score_rows(self, hidden, seq, first, lo, hi, top_k, picked, top, head_rows: int = 4096) -> None:
        """log p(seq[p + 1]) for positions p in [lo, hi), where hidden[0] is position ``first``. The LM head and
        log_softmax run over at most head_rows positions at a time, so [tokens, vocab] logits are never held at
        once (8.6 GB in fp32 for 64K tokens of a 163K vocabulary)."""
        for a in range(lo, hi, head_rows):
            b = min(a + head_rows, hi)
            log_probs = self.model.lm_head(hidden[a - first:b - first]).float().log_softmax(-1)
            targets = torch.tensor(seq[a + 1:b + 1], device=self.device)
            picked += log_probs.gather(1, targets[:, None])[:, 0].tolist()
            if top is not None:
                values, index = log_probs.topk(top_k, dim=-1)
                top += [list(zip(i_row, v_row)) for i_row, v_row in zip(index.tolist(), values.tolist())]

    # --- warm-up ------------------------------------------------------------------------------------
    def warmup(self) -> float:
        """Build now what the first requests would build lazily: the decode CUDA graphs for every batch size up
        to max_batch (compiled with K3_COMPILE_DECODE), prefills of one full chunk, of a multiple of 64 tokens, of
        two short prompts sharing a padded forward and of 16 rows at once where max_batch allows (kernels autotune
        and specialise per shape), within the context's room a chunk and 64 tokens more (attention after cached
        tokens), with the prefix cache two prompts saving states on their way and their next turns' tails after
        those states, greedy and sampled decoding with logprobs. Leaves no trace: the prefix cache and the
        counters are as before. Returns the seconds it took."""
        start = time.perf_counter()
        if not (self.scheduler.waiting or self.scheduler.running):
            self._land()  # an idle engine's last step in flight holds only finished rows
        if self.has_unfinished():
            raise RuntimeError("warm up an idle engine: requests are queued or running")
        counters = dict(self.stats_counters)
        prefix = self.prefix_cache
        prefix_counts = (prefix.hits, prefix.hit_tokens) if prefix is not None else None
        runner = self.runner
        if runner.use_cuda_graphs:
            top = next((b for b in runner.graph_batch_sizes if b >= self.max_batch), runner.graph_batch_sizes[-1])
            runner.capture(tuple(b for b in runner.graph_batch_sizes if b <= top))
        greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
        sampled = SamplingParams(max_new_tokens=2, temperature=1.0, top_p=0.9, top_k=50, logprobs=1, seed=0)
        length = min(self.scheduler.prefill_chunk, self.max_context - greedy.max_new_tokens - 1)
        while length > 1:
            try:
                self.check_prompt([0] * length, greedy)
                break
            except ValueError:  # the page pool cannot hold a full chunk: a shorter prompt still warms up
                length //= 2
        # Kernels specialise on a length's divisibility (Triton: by 16), so a full chunk that is not a multiple of
        # 64 leaves a round prompt's first forward compiling: one of each, then two short prompts of different
        # lengths, which share one padded forward (prefill_forwards), with sampling and logprobs.
        # Each prompt repeats its own token, so none is a prefix-cache hit of another.
        length = max(1, length)
        for token, size in enumerate(sorted({length, length // 64 * 64} - {0}, reverse=True)):
            self.complete([[token] * size], greedy)
        self.complete([[2] * min(length, 17), [3] * min(length, 15)], [greedy, sampled])
        # Triton specialises an integer argument that is a multiple of 16 apart from others, so a forward of 16 rows
        # (or 32, 48, ...) may run other builds of the kernels than 1 or 2 rows do. (On one H100 the first burst
        # of 16 prompts after a warm-up without it still compiled: TTFT p50 0.5-1.1 s against 0.2-0.3 after.)
        if self.max_batch >= WARM_ROWS and WARM_ROW_TOKENS + greedy.max_new_tokens < self.max_context:
            vocab = self.config.vocab_size
            self.complete([[(8 + row) % vocab] * WARM_ROW_TOKENS for row in range(WARM_ROWS)], greedy)
        # Attention after cached tokens is a path of its own (a lower-right causal mask, whose first use imports
        # torch._dynamo: a fresh engine's first long prompt took 1.26 s against 0.09 after, debug preset, CPU):
        # a chunk and 64 tokens more, where the context holds it.
        room = self.max_context - greedy.max_new_tokens
        if self.scheduler.prefill_chunk + 64 < room:
            self.complete([[4] * (self.scheduler.prefill_chunk + 64)], greedy)
        # The prefix cache's paths: two prompts whose forward saves a state on its way (StateSnapshot), then their
        # next turns, which hit those states and prefill short tails from two positions in one forward.
        size = self.pool.page_size
        if self.prefix_cache is not None and self.max_batch >= 2 and 3 * size + size // 2 + 8 < room:
            self.complete([[5] * (2 * size + size // 2), [6] * (3 * size + size // 2)], greedy)
            self.complete([[5] * 2 * size + [7] * 8, [6] * 3 * size + [7] * 8], [greedy, sampled])
        self.clear_prefix_cache()
        self.stats_counters = counters
        if prefix_counts is not None:
            self.prefix_cache.hits, self.prefix_cache.hit_tokens = prefix_counts
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    # --- accounting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Queue and memory counters. kda_slots_used / mla_pages_used count what requests hold (0 when idle);
        the prefix cache's own states and pages are counted apart."""
        pool = self.pool
        running = self.scheduler.running_sequences()
        slots, pages = set(), set()
        for request in self.scheduler.running:
            for seq in request.sequences:
                if seq.slot is not None:
                    slots.add(seq.slot)
                pages.update(seq.pages)
            slots.update(request.reserved_slots)
            for own in request.reserved_pages:
                pages.update(own)
        prefix = self.prefix_cache
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(running),
            "prefilling": sum(s.status == PREFILL for s in running),
            "kda_slots_total": pool.num_slots,
            "kda_slots_used": len(slots),
            "mla_pages_total": pool.num_pages,
            "mla_pages_used": len(pages),
            "mla_pages_free": pool.free_pages,
            "prefix_entries": len(prefix) if prefix is not None else 0,
            "prefix_cache_hits": prefix.hits if prefix is not None else 0,
            "prefix_cache_hit_tokens": prefix.hit_tokens if prefix is not None else 0,
            **self.stats_counters,
        }

    def clear_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def weights_changed(self) -> None:
        """Call after the model's weights were updated in place (an RL step): cached prefix states were computed
        with the old weights and go. CUDA graphs read the parameters where they are, so they stay valid as long
        as the update is in place (optimizer steps are)."""
        self.clear_prefix_cache()


@torch.no_grad()
def greedy_without_cache(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: every step recomputes the full forward over prompt + generated tokens (no cache)."""
    ids = list(prompt)
    device = next(model.parameters()).device
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids], device=device)).logits[0, -1]
        ids.append(int(logits.float().argmax()))
    return ids[len(prompt):]
