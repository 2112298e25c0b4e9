"""What multi-teacher distillation reads: prompts by domain, the teachers that score them, and the check
that every teacher speaks the student's tokenizer.

Prompts. ``--data NAME=PATH`` gives domain NAME its prompts. PATH is a .jsonl file (one object per line:
``{"prompt": ..., "completion": ...}`` where the completion is an optional reference answer for the held-out
loss, or ``{"text": ...}``; a ``"domain"`` field sends that line to another domain's teacher) or text data that
k3.data.corpus reads (.txt, .parquet, a directory). A text document is cut into windows of
``prompt_tokens + reference_tokens`` tokens: the first part is the prompt, the rest the reference continuation.
Each domain's items are shuffled once by a seed; the first ``heldout`` of them are the fixed held-out set, the
rest the training prompts.

Teachers. A teacher is an engine over its model (k3.infer.Engine) in this process (``LocalTeacher``) or in a
Ray actor (``RayTeacher``, same methods). It scores given tokens by packed prefill (``score``), samples
(``sample``, for the offline baselines) and gives next-token distributions (``log_softmax``, for exact held-out
KL). Routing: every item carries its domain and only that domain's teacher sees it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PROBE_TEXTS = ("def main():\n    return 0\n", "The quick brown fox jumps over the lazy dog.", "3+4=7; 12*3=36",
               "  indented\ttabs\nnew lines\n\n", "\u00e9l\u00e8ve \u4e2d\u6587 \U0001f600")


@dataclass
class Item:
    """One prompt of one domain: prompt ids, and a reference continuation (ids, possibly empty) for the held-out
    loss; ``task`` the k3.rl task whose verifier rewards the completion (--rl-suite), else None."""

    domain: str
    prompt: list[int]
    reference: list[int]
    task: Any = None


# --- tokenizers --------------------------------------------------------------------------------------------
def tokenizer_fingerprint(tokenizer) -> dict:
    """What must agree between two tokenizers for one's ids to mean the other's tokens."""
    vocab = None
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and callable(getattr(backend, "get_vocab", None)):
        vocab = backend.get_vocab()
    elif isinstance(getattr(tokenizer, "ranks", None), dict):
        vocab = {k.decode("latin-1"): v for k, v in tokenizer.ranks.items()}
    return {"vocab_size": getattr(tokenizer, "vocab_size", None), "eos_token_id": getattr(tokenizer, "eos_token_id", None),
            "vocab": vocab, "probes": [tokenizer.encode(text) for text in PROBE_TEXTS]}


def check_shared_tokenizer(student, teachers: dict[str, object]) -> None:
    """Raise ValueError naming the first teacher whose tokenizer is not the student's, and how it differs.

    Reverse KL compares log p_student(y_t) with log p_teacher(y_t) for the same id y_t: that is only meaningful
    when the id is the same token for both."""
    reference = tokenizer_fingerprint(student)
    for name, tokenizer in teachers.items():
        other = tokenizer_fingerprint(tokenizer)
        problem = None
        if other["vocab_size"] != reference["vocab_size"]:
            problem = f"its vocabulary has {other['vocab_size']} ids, the student's {reference['vocab_size']}"
        elif other["eos_token_id"] != reference["eos_token_id"]:
            problem = f"its EOS id is {other['eos_token_id']}, the student's {reference['eos_token_id']}"
        elif reference["vocab"] is not None and other["vocab"] is not None and other["vocab"] != reference["vocab"]:
            differing = sorted(t for t in set(reference["vocab"]) | set(other["vocab"])
                               if reference["vocab"].get(t) != other["vocab"].get(t))
            problem = f"{len(differing)} tokens have other ids (e.g. {differing[:3]!r})"
        else:
            for text, mine, theirs in zip(PROBE_TEXTS, reference["probes"], other["probes"]):
                if mine != theirs:
                    problem = f"it encodes {text!r} as {theirs[:8]}..., the student as {mine[:8]}..."
                    break
        if problem:
            raise ValueError(f"teacher {name!r} does not share the student's tokenizer: {problem}. On-policy "
                             f"distillation scores the student's own token ids under the teacher, so both must use "
                             f"one tokenizer; distil from a teacher trained with the student's tokenizer (e.g. "
                             f"k3 train --tokenizer STUDENT_RUN/tokenizer)")


# --- prompts -----------------------------------------------------------------------------------------------
def _jsonl_items(path: Path, domain: str, tokenizer, prompt_tokens: int, reference_tokens: int) -> list[Item]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from error
        where = row.get("domain", domain)
        if "prompt" in row:
            items.append(Item(where, tokenizer.encode(row["prompt"]), tokenizer.encode(row.get("completion", ""))))
        elif "text" in row:
            items.extend(_windows(tokenizer.encode(row["text"]), where, prompt_tokens, reference_tokens))
        else:
            raise ValueError(f"{path}:{number}: a line needs a \"prompt\" (optionally \"completion\") or a \"text\"")
    return items


def _windows(ids: list[int], domain: str, prompt_tokens: int, reference_tokens: int) -> list[Item]:
    width = prompt_tokens + reference_tokens
    return [Item(domain, ids[i:i + prompt_tokens], ids[i + prompt_tokens:i + width])
            for i in range(0, len(ids) - width + 1, width)]


def load_items(data: dict[str, str], tokenizer, prompt_tokens: int, reference_tokens: int) -> list[Item]:
    """Every item of every --data source, in file order (see the module doc for the formats)."""
    from k3.data.corpus import load_corpus

    items: list[Item] = []
    for domain, source in data.items():
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"--data {domain}={source}: no such file or directory")
        if path.suffix == ".jsonl":
            found = _jsonl_items(path, domain, tokenizer, prompt_tokens, reference_tokens)
        else:
            found = [item for doc in load_corpus([path])
                     for item in _windows(tokenizer.encode(doc.text), domain, prompt_tokens, reference_tokens)]
        if not found:
            raise ValueError(f"--data {domain}={source} gave no prompts (text shorter than "
                             f"{prompt_tokens + reference_tokens} tokens, or an empty file)")
        items.extend(found)
    return items


class PromptSets:
    """Items split per domain into a fixed held-out set and the training prompts; ``for_step`` draws a step's
    prompts from (seed, step) alone, so a resumed run draws the very same. ``fixed_heldout`` gives a domain its
    held-out set instead (an RL suite's own held-out split); all of that domain's ``items`` then train."""

    def __init__(self, items: list[Item], domains: list[str], heldout: int, seed: int,
                 fixed_heldout: dict[str, list[Item]] | None = None) -> None:
        fixed_heldout = fixed_heldout or {}
        self.domains = list(domains)
        self.seed = seed
        unknown = sorted({item.domain for item in items} - set(domains))
        if unknown:
            raise ValueError(f"prompts of domain(s) {unknown} have no teacher; give --teacher NAME=PATH for each, or "
                             f"fix the \"domain\" fields (teachers: {sorted(domains)})")
        self.train: dict[str, list[Item]] = {}
        self.heldout: dict[str, list[Item]] = {}
        for domain in domains:
            mine = [item for item in items if item.domain == domain]
            random.Random(f"{seed}/split/{domain}").shuffle(mine)
            if domain in fixed_heldout:
                self.heldout[domain], self.train[domain] = list(fixed_heldout[domain]), mine
                continue
            if len(mine) <= heldout:
                raise ValueError(f"domain {domain!r} has {len(mine)} prompts; it needs more than the {heldout} held "
                                 f"out (give more data or a smaller heldout_prompts)")
            self.heldout[domain], self.train[domain] = mine[:heldout], mine[heldout:]

    def for_step(self, step: int, per_domain: int) -> list[Item]:
        out = []
        for domain in self.domains:
            rng = random.Random(f"{self.seed}/{step}/{domain}")
            out.extend(rng.choice(self.train[domain]) for _ in range(per_domain))
        return out


def route(items: list[Item]) -> dict[str, list[int]]:
    """Domain -> the indices of its items (in order): each domain's teacher scores these and nothing else."""
    groups: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(item.domain, []).append(index)
    return groups


# --- teachers ----------------------------------------------------------------------------------------------
def load_model_and_tokenizer(path: str, device: str):
    """A k3 run (directory with checkpoint.pt / checkpoint/, or a checkpoint file) or a Hugging Face-format
    directory (Kimi-Linear, K3: config.json + safetensors) -> (model, tokenizer)."""
    from k3.checkpoint.inference import load_for_inference

    where = Path(path)
    if not where.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint (give a k3 run directory or a Hugging Face-format "
                                f"directory)")
    is_run = where.is_file() or (where / "checkpoint.pt").is_file() or (where / "checkpoint").is_dir()
    return load_for_inference(path if is_run else None, None if is_run else path, device)


def packed_log_softmax(model, sequences: list[list[int]], starts: list[int], device) -> list[torch.Tensor]:
    """Next-token log-distributions [len_i - start_i, V]: row j is log p(. | seq[:start_i + j]), the distribution
    token seq[start_i + j] was drawn from. One packed forward (documents never see each other)."""
    ids = torch.tensor([t for s in sequences for t in s], device=device)[None]
    lengths = [len(s) for s in sequences]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), device=device, dtype=torch.int32)
    logits = model(ids, cu_seqlens=cu).logits[0].float()
    out, offset = [], 0
    for start, length in zip(starts, lengths):
        out.append(torch.log_softmax(logits[offset + start - 1: offset + length - 1], -1))
        offset += length
    return out


class LocalTeacher:
    """A teacher in this process: its own engine over its model."""

    def __init__(self, name: str, model, tokenizer, max_context: int = 1024, max_batch: int = 64) -> None:
        from k3.infer.engine import Engine

        self.name, self.model, self.tokenizer = name, model.eval(), tokenizer
        self.engine = Engine(self.model, tokenizer, max_context=max_context, max_batch=max_batch)
        self.vocab_size = model.config.vocab_size

    @classmethod
    def load(cls, name: str, path: str, device: str = "auto", max_context: int = 1024) -> "LocalTeacher":
        model, tokenizer = load_model_and_tokenizer(path, device)
        return cls(name, model, tokenizer, max_context)

    def score(self, sequences: list[list[int]], starts: list[int], top_k: int = 0):
        """-> list of k3.infer.engine.ScoreOutput (logprobs of seq[start:], top-k when asked)."""
        return self.engine.score(sequences, starts, top_k=top_k)

    def sample(self, prompts: list[list[int]], params):
        """-> list of k3.infer.engine.RequestOutput."""
        return self.engine.complete(prompts, params)

    @torch.no_grad()
    def log_softmax(self, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
        device = next(self.model.parameters()).device
        return [row.cpu() for row in packed_log_softmax(self.model, sequences, starts, device)]


class RayTeacher:
    """The same teacher in a Ray actor (another process or machine): LocalTeacher's methods, each a blocking
    remote call. ``resources`` is passed to the actor (e.g. {"num_gpus": 1})."""

    def __init__(self, name: str, path: str, device: str = "auto", max_context: int = 1024,
                 resources: dict | None = None) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayTeacher needs a running Ray: call ray.init() (or ray.init(address=...)) first")
        actor = ray.remote(**(resources or {"num_cpus": 1}))(_TeacherActor)
        self.name, self._ray = name, ray
        self.actor = actor.remote(name, path, device, max_context)
        self.tokenizer = ray.get(self.actor.tokenizer.remote())
        self.vocab_size = ray.get(self.actor.vocab_size.remote())

    def score(self, sequences, starts, top_k: int = 0):
        return self._ray.get(self.actor.score.remote(sequences, starts, top_k))

    def sample(self, prompts, params):
        return self._ray.get(self.actor.sample.remote(prompts, params))

    def log_softmax(self, sequences, starts):
        return self._ray.get(self.actor.log_softmax.remote(sequences, starts))

    def close(self) -> None:
        self._ray.kill(self.actor)


class _TeacherActor:
    def __init__(self, name: str, path: str, device: str, max_context: int) -> None:
        torch.set_num_threads(1)
        self.teacher = LocalTeacher.load(name, path, device, max_context)

    def tokenizer(self):
        return self.teacher.tokenizer

    def vocab_size(self) -> int:
        return self.teacher.vocab_size

    def score(self, sequences, starts, top_k):
        return self.teacher.score(sequences, starts, top_k)

    def sample(self, prompts, params):
        return self.teacher.sample(prompts, params)

    def log_softmax(self, sequences, starts):
        return self.teacher.log_softmax(sequences, starts)
