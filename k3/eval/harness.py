"""Accuracy of a model on task examples, through the inference engine.

An example with one answer at its end is a prompt to complete: the engine decodes len(answer) tokens
greedily (batched prefill, then decode) and the answer must match exactly. An example with several answers
inside it (MQAR) is scored in place by one packed prefill (`Engine.score` with top-1): every answer token
must be the argmax given the true prefix. For a single final answer the two agree (greedy decoding emits the
answer iff each answer token is the argmax after the previous ones); tests/eval holds them equal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from k3.eval.tasks import Example
from k3.infer.engine import Engine
from k3.infer.memory_budget import release_cached_memory
from k3.infer.sampling import SamplingParams

# Tokens one engine holds at once (prompt + generation over its batch): bounds the MLA page pool.
ENGINE_TOKEN_BUDGET = 1 << 18


@dataclass
class TaskResult:
    task: str
    length: int
    correct: int
    n: int
    seconds: float = 0.0  # wall time of this task at this length (examples built and evaluated)
    peak_gib: float | None = None  # peak CUDA memory allocated meanwhile; None off CUDA

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def row(self) -> dict:
        return {"task": self.task, "length": self.length, "accuracy": self.accuracy, "n": self.n}


def engine_for(model, tokenizer, length: int, answer_room: int = 64) -> Engine:
    """An engine sized for sequences of `length` tokens: as many at once as fit the token budget."""
    context = length + answer_room
    max_batch = max(1, min(32, ENGINE_TOKEN_BUDGET // context))
    # The engine sizes its prefill chunks from max_context (k3.infer.engine.long_prefill_chunk).
    return Engine(model, tokenizer, max_context=context, max_batch=max_batch, prefix_cache=False)


def generated_correct(engine: Engine, examples: list[Example]) -> list[bool]:
    """Greedy completion of each example's prompt; True where it reproduces the answer exactly."""
    correct: list[bool] = [False] * len(examples)
    by_answer_length: dict[int, list[int]] = {}
    for i, example in enumerate(examples):
        by_answer_length.setdefault(len(example.answer()), []).append(i)
    for answer_length, indices in by_answer_length.items():
        prompts = [examples[i].ids[:examples[i].answer_spans[0][0]] for i in indices]
        # No stop tokens: an early EOS is simply a wrong answer, and the comparison sees it.
        params = SamplingParams(max_new_tokens=answer_length, temperature=0.0)
        outputs = engine.generate_ids(prompts, params)
        for i, out in zip(indices, outputs):
            correct[i] = out[:answer_length] == examples[i].answer()
    return correct


def scored_correct(engine: Engine, examples: list[Example]) -> list[list[bool]]:
    """Teacher-forced: for each example, one flag per answer span (all its tokens are the top-1)."""
    starts = [ex.answer_spans[0][0] for ex in examples]
    outputs = engine.score([ex.ids for ex in examples], starts, top_k=1)
    flags = []
    for ex, start, out in zip(examples, starts, outputs):
        top1 = [top[0][0] for top in out.top_logprobs]  # top1[j] predicts ids[start + j]
        flags.append([all(top1[t - start] == ex.ids[t] for t in range(a, b)) for a, b in ex.answer_spans])
    return flags


def evaluate_examples(engine: Engine, task: str, length: int, examples: list[Example],
                      mode: str = "auto") -> TaskResult:
    """mode: "auto" (generate single final answers, score the rest), "generate" or "score"."""
    if mode not in ("auto", "generate", "score"):
        raise ValueError(f"mode must be auto, generate or score, got {mode!r}")
    generate = [ex for ex in examples if ex.single_final_answer and mode != "score"]
    rest = [ex for ex in examples if not (ex.single_final_answer and mode != "score")]
    if mode == "generate" and rest:
        raise ValueError(f"{task} examples hold answers inside the sequence; they can only be scored in place "
                         "(mode score or auto)")
    correct = n = 0
    if generate:
        flags = generated_correct(engine, generate)
        correct += sum(flags)
        n += len(flags)
    if rest:
        for flags in scored_correct(engine, rest):
            correct += sum(flags)
            n += len(flags)
    return TaskResult(task, length, correct, n)


def evaluate_tasks(model, tokenizer, ctx, tasks: list[str], lengths: list[int], count: int, seed: int = 0,
                   mode: str = "auto", show_progress: bool = True) -> list[TaskResult]:
    """Every task at every length: `count` fresh examples each. One engine per length."""
    from k3.eval.tasks import make_examples

    results = []
    bar = tqdm(total=len(tasks) * len(lengths), desc="eval", unit="task", disable=not show_progress)
    for length in lengths:
        engine = engine_for(model, tokenizer, length)
        for task in tasks:
            bar.set_postfix(task=task, length=length)
            on_cuda = engine.device.type == "cuda"
            if on_cuda:
                torch.cuda.synchronize(engine.device)
                torch.cuda.reset_peak_memory_stats(engine.device)
            start = time.perf_counter()
            examples = make_examples(task, ctx, length, count, seed)
            result = evaluate_examples(engine, task, length, examples, mode)
            if on_cuda:
                torch.cuda.synchronize(engine.device)
                result.peak_gib = torch.cuda.max_memory_allocated(engine.device) / 2**30
            result.seconds = time.perf_counter() - start
            results.append(result)
            bar.update(1)
        del engine
        release_cached_memory()
    bar.close()
    return results
