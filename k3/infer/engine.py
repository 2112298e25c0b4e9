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

import itertools
import time
from dataclasses import dataclass, field

import torch

from k3.infer.cache_pool import CachePool
from k3.kernels import applied as kernels_applied
from k3.infer.prefix_cache import PrefixCache
from k3.infer.runner import ModelRunner
from k3.infer.sampling import SamplingParams, sample_rows
from k3.infer.scheduler import DECODE, FINISHED, PREFILL, Request, Scheduler, Sequence, pages_for


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


def default_prefill_chunk(max_context: int, on_gpu: bool) -> tuple[int, int]:
    """(prefill chunk, prefill tokens a step or a scoring forward takes) for an engine of max_context tokens.

    On a GPU a prefill forward of a mid-size model is bound by kernel launches up to several thousand tokens
    (measured for `small` on one H200: a 512-token chunk 9 ms of GPU work under 78 ms of host time; an 8K prompt
    through the engine in 2,048-token chunks 616 ms, as one 8K forward 146 ms), so the short chunk is 8,192 tokens
    there and 512 elsewhere; long contexts take longer ones (long_prefill_chunk). A step's prefills (and a scoring
    forward) take four long chunks' tokens, or with the short chunk 8,192 on a GPU (the four 2,048-token chunks
    of before) and 2,048 (four chunks) elsewhere."""
    short = 8192 if on_gpu else 512
    long_chunk = long_prefill_chunk(max_context)
    if long_chunk and long_chunk > short:
        return long_chunk, 4 * long_chunk
    return short, 8192 if on_gpu else 2048


def long_prefill_chunk(length: int) -> int | None:
    """Prefill chunk for contexts of `length` tokens: None (the engine's short default) up to 32K, then
    length/16 in multiples of 2,048, at most 65,536. Each chunk after the first up-projects MLA's keys and
    values over the whole context so far, so a 1M prompt in the default 2,048-token chunks would do that 512
    times; 16 chunks keep it cheap while one chunk's MoE intermediate stays far below one whole-prompt forward's."""
    chunk = (length // 16) // 2048 * 2048
    return min(65536, chunk) if chunk > 2048 else None


class Engine:
    """model: K3ForCausalLM (put in eval mode here); tokenizer: the project's tokenizer interface or None.

    max_context: longest prompt + generation per sequence. max_batch: most sequences running at once (KDA
    slots for requests). page_size: tokens per MLA page. prefill_chunk: longest prefill forward (a multiple of
    page_size; default_prefill_chunk's by default). max_step_tokens: token budget of a step (decodes count one
    each; default: default_prefill_chunk's step tokens, or four chunks, plus max_batch). prefix_slots: KDA slots
    kept for prefix-cache states (0 turns prefix caching off). num_pages: MLA pages in the pool (default:
    enough for max_batch full contexts). fuse_weights: run projections that read one input as one GEMM over
    one weight buffer (k3.layers.fused_weights; names and state_dict unchanged); default: with CUDA graphs,
    for a model whose parameters are all frozen. kernels: k3.kernels choices held while the engine works (setup,
    steps, scoring), e.g. {"moe": "torch"}."""

    @kernels_applied
    def __init__(self, model, tokenizer=None, max_context: int = 4096, max_batch: int = 32, page_size: int = 32,
                 prefill_chunk: int | None = None, max_step_tokens: int | None = None, prefix_cache: bool = True,
                 prefix_slots: int | None = None, num_pages: int | None = None, dtype: torch.dtype | None = None,
                 use_cuda_graphs: bool | None = None, record_routing: bool = False,
                 fuse_weights: bool | None = None, *, kernels: dict[str, str] | None = None) -> None:
        if max_context < 2:
            raise ValueError(f"max_context must be >= 2 (a prompt token and a new one), got {max_context}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if record_routing:
            # Recording runs Python hooks in every forward (no CUDA graphs), and a prompt's routing must come
            # from its own prefill (a prefix-cache hit would skip it).
            if use_cuda_graphs:
                raise ValueError("record_routing needs eager decode steps; leave use_cuda_graphs unset or False")
            use_cuda_graphs, prefix_cache = False, False
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.max_context, self.max_batch = max_context, max_batch
        self.device = next(model.parameters()).device
        dtype = dtype or next(model.parameters()).dtype
        batch_tokens = None
        if prefill_chunk is None:
            prefill_chunk, batch_tokens = default_prefill_chunk(max_context, self.device.type == "cuda")
        prefill_chunk = max(page_size, (prefill_chunk // page_size) * page_size)
        # Tokens of a step's prefills and of a scoring forward (decoding rows add one each to a step).
        self.batch_tokens = batch_tokens or 4 * prefill_chunk
        max_pages = pages_for(max_context, page_size)
        prefix_slots = (max_batch if prefix_cache else 0) if prefix_slots is None else prefix_slots
        if num_pages is None:
            num_pages = max_batch * max_pages + (prefix_slots * max_pages // 2)
            if self.device.type == "cuda":
                # Full contexts for every slot can outgrow the GPU at long contexts: keep the pages within
                # half of the free memory; admission then waits for pages instead of the allocation failing.
                page_bytes = (self.config.layer_types.count("mla") * page_size
                              * (self.config.kv_lora_rank + self.config.qk_rope_head_dim) * dtype.itemsize)
                free, _ = torch.cuda.mem_get_info(self.device)
                num_pages = max(max_pages, min(num_pages, int(0.5 * free) // max(page_bytes, 1)))
        self.pool = CachePool(self.config, max_batch + prefix_slots, num_pages, page_size, self.device, dtype)
        self.prefill_fit = None
        if self.device.type == "cuda" and batch_tokens is not None and max_step_tokens is None:
            # The default sizes come from max_context; what is left of the device after the weights and the pool
            # may hold less (k3.infer.memory_budget). Cached blocks the allocator holds count as free.
            from k3.infer.memory_budget import fit_prefill

            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            self.prefill_fit = fit_prefill(self.config, max_context, prefill_chunk, self.batch_tokens, free,
                                           dtype.itemsize, quantum=max(page_size, 2048))
            prefill_chunk = max(page_size, self.prefill_fit.chunk // page_size * page_size)
            self.batch_tokens = self.prefill_fit.step_tokens
        self.prefix_cache = PrefixCache(self.pool, prefix_slots) if prefix_slots > 0 else None
        self.scheduler = Scheduler(self.pool, self.prefix_cache, max_batch, max_context, prefill_chunk,
                                   max_step_tokens or self.batch_tokens + max_batch)
        if use_cuda_graphs is None:
            # The MoE layers capture only on the bf16 grouped-GEMM path; the expert loop (other dtypes) reads
            # its counts back to the host, which a graph cannot hold.
            use_cuda_graphs = self.device.type == "cuda" and (dtype == torch.bfloat16 or not model.routers())
        if fuse_weights is None:
            # Projections that read one input become one GEMM over one weight buffer (k3.layers.fused_weights):
            # worth it where launches set the step (graphs); only for frozen copies, whose weights the engine
            # alone reads (a model being trained keeps its separate projections either way).
            fuse_weights = use_cuda_graphs and not any(p.requires_grad for p in model.parameters())
        if fuse_weights:
            from k3.layers.fused_weights import fuse_model_weights

            fuse_model_weights(model)
        # K3_COMPILE_DECODE=1 compiles the decode step (k3.infer.runner); recording routes runs Python hooks in
        # every forward, which a compiled graph would not run.
        self.runner = ModelRunner(self.model, self.pool, max_pages, use_cuda_graphs,
                                  compile_decode=False if record_routing else None)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.record_routing = record_routing
        self._routes: list[list[torch.Tensor]] | None = None  # filled by the router hooks during a step's forward
        if record_routing:
            for index, (_, router) in enumerate(model.routers()):
                router.register_forward_hook(self._route_hook(index))
            self._num_moe = len(model.routers())
        self.stats_counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "finished": 0}
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
        if not ids:
            raise ValueError(f"{name} is empty after tokenization; give at least one token")
        if len(ids) >= self.max_context:
            raise ValueError(f"{name} has {len(ids)} tokens but the context allows {self.max_context} (prompt "
                             f"plus at least one new token); shorten it or raise max_context")
        vocab = self.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"{name} holds token ids outside [0, {vocab}); the tokenizer does not match the model")
        if params.n > self.max_batch:
            raise ValueError(f"n={params.n} samples cannot run at once with max_batch={self.max_batch}")
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
        self.scheduler.waiting.append(request)
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

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # --- routing capture ----------------------------------------------------------------------------
    def _route_hook(self, index: int):
        def hook(module, args, output) -> None:
            if self._routes is not None:
                self._routes[index].append(output.topk_ids_TK.detach())
        return hook

    def _capture(self, seqs: list[Sequence], run):
        """Run a forward; with record_routing, append each row's expert ids ([T, K] per MoE layer) to it."""
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
                    seq.routing[layer].append(ids[row])
        finally:
            self._routes = None
        return out

    # --- the step -----------------------------------------------------------------------------------
    @kernels_applied
    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.plan()
        rows: list[Sequence] = []
        logits = []
        if plan.decodes:
            logits.append(self._capture(plan.decodes, lambda: self.runner.decode(plan.decodes)))
            for seq in plan.decodes:
                seq.num_cached += 1
            rows.extend(plan.decodes)
        groups: dict[tuple[int, int, bool], list[Sequence]] = {}
        for seq, start, end in plan.prefills:
            groups.setdefault((start, end, seq.prompt_embeds is not None), []).append(seq)
        for (start, end, _), seqs in groups.items():
            last_rows = self._capture(seqs, lambda: self.runner.prefill(seqs, start, end))
            for seq, last in zip(seqs, last_rows):
                seq.num_cached = end
                self.stats_counters["prompt_tokens"] += end - start
                if self.prefix_cache is not None and end in seq.register_at:
                    self.prefix_cache.insert(seq.tokens, end, seq.pages, seq.slot)
                if end == seq.prompt_len:
                    seq.status = DECODE
                    request = self.requests[seq.request_id]
                    group = [seq] + (self.scheduler.fork(request) if request.params.n > 1 else [])
                    logits.append(last[None].expand(len(group), -1))
                    rows.extend(group)
        self.stats_counters["steps"] += 1
        if not rows:
            return []
        events = self._sample(rows, torch.cat(logits))
        for request in self.scheduler.remove_finished():
            self.requests.pop(request.request_id, None)
            self.stats_counters["finished"] += 1
        return events

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

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
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
        sampled = sample_rows(logits, params, generators, counts, want_logprobs=want, top_n=top_n)
        tokens = sampled.tokens.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        now = time.monotonic()
        events = []
        for row, (seq, p, token) in enumerate(zip(rows, params, tokens)):
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
        self.stats_counters["generated_tokens"] += len(tokens)
        return events

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop and self._hits_stop_string(seq):
            return "stop"
        if seq.matcher is not None and seq.matcher.stopped:  # the grammar is complete
            return "stop"
        if len(seq.generated) >= seq.params.max_new_tokens or len(seq.tokens) >= self.max_context:
            return "length"
        return None

    def _hits_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.generated)
        longest = max(len(s) for s in seq.params.stop)
        # Only text that can still complete a stop string is searched again (with a margin: a multi-byte
        # character decodes as replacement characters until its last byte arrives, then shrinks).
        window = text[max(0, seq.text_offset - longest - 8):]
        seq.text_offset = len(text)
        return any(s in window for s in seq.params.stop)

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
        to max_batch (compiled with K3_COMPILE_DECODE), a prefill of one full chunk and a short one (kernels
        autotune per shape), greedy and sampled decoding with logprobs. Leaves no trace: the prefix cache and
        the counters are as before. Returns the seconds it took."""
        start = time.perf_counter()
        if self.has_unfinished():
            raise RuntimeError("warm up an idle engine: requests are queued or running")
        counters = dict(self.stats_counters)
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
        prompts = [[0] * max(1, length), [0] * max(1, min(length, 17))]
        self.complete(prompts, [greedy, sampled][:len(prompts)])
        self.clear_prefix_cache()
        self.stats_counters = counters
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
