"""Task rewards for `k3 distill --rl-suite NAME[:WEIGHT]`: an RL suite's verifiable reward mixed into the
on-policy distillation advantage.

Scope: single-turn, answer-checked tasks. Each task's prompt is rendered as `k3 rl` renders the first turn of
its episode (system text with the tool list, the user message, the assistant marker: k3.rl.rollout's
initial_messages); the student answers in that one turn; the answer is the ``answer`` of a ``submit`` tool
call in it, or the turn's whole text when it holds no tool call (k3.rl.rollout's convention), and None when
it calls another tool (no tool runs here: reward 0). The task's verifier scores the answer without a sandbox
(k3.rl.verify.score): "answer" verifiers (calc) and "python" verifiers that read only the answer. Tasks with
a "command" verifier need the episode's sandbox and are refused (multi-turn sandboxed episodes are `k3 rl`'s).

A suite is a domain of its own: its prompts are scored by the teacher of that name (``--teacher calc=DIR``)
for the reverse-KL term, and every sampled token of a completion gets, on top of its reverse-KL advantage,

    WEIGHT * (R - mean of R over the G completions of the same prompt)

(the reward centred in its group, not divided by the group's std; the dense KL advantage is never
normalised). Held-out: the suite's own held-out split; ``heldout_pass/NAME`` is the mean reward there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from k3.rl.chat_format import parse_tool_calls, render_ids
from k3.rl.distill_sources import Item
from k3.rl.losses import group_advantages
from k3.rl.tasks import Task
from k3.rl.verify import score


@dataclass
class RewardSuite:
    """A suite's domain name, its reward weight and its train / held-out tasks."""

    name: str
    weight: float
    train: list[Task]
    heldout: list[Task]


def parse_rl_suite(spec: str) -> tuple[str, float]:
    """"calc" -> ("calc", 1.0); "calc:0.5" -> ("calc", 0.5); a path may hold colons only before the weight."""
    name, sep, weight = spec.rpartition(":")
    if sep:
        try:
            return name, float(weight)
        except ValueError:
            pass
    if not spec:
        raise ValueError("--rl-suite takes NAME[:WEIGHT] (a built-in suite such as calc, or a task file)")
    return spec, 1.0


def suite_domain(name: str) -> str:
    """The domain a suite's prompts belong to: a built-in suite's name, or a task file's stem."""
    from k3.rl.suites import SUITE_NAMES

    return name if name in SUITE_NAMES else Path(name).stem


def load_reward_suite(name: str, weight: float, train_count: int, heldout_count: int) -> RewardSuite:
    """A built-in suite (its first ``train_count`` / ``heldout_count`` tasks of each split) or a task file /
    directory (k3.rl.tasks.load_tasks; split by each task's ``split``)."""
    from k3.rl.suites import SUITE_NAMES, get_suite
    from k3.rl.tasks import load_tasks

    if name in SUITE_NAMES:
        suite = get_suite(name)
        train, heldout = suite.tasks("train", train_count), suite.tasks("heldout", heldout_count)
    else:
        tasks = load_tasks(name)
        train = [t for t in tasks if t.split == "train"]
        heldout = [t for t in tasks if t.split == "heldout"][:heldout_count]
    for task in train + heldout:
        if task.verifier.type == "command":
            raise ValueError(f"--rl-suite {name}: task {task.id} has a command verifier, which runs in the "
                             f"episode's sandbox; k3 distill scores single-turn answers only (answer and python "
                             f"verifiers). Use k3 rl for sandboxed multi-turn episodes")
    if not train or not heldout:
        raise ValueError(f"--rl-suite {name}: needs tasks of both splits, got {len(train)} train and {len(heldout)} "
                         f"held-out")
    return RewardSuite(suite_domain(name), weight, train, heldout)


def task_prompt_ids(task: Task, tokenizer) -> list[int]:
    """The ids of the first turn's prompt, as `k3 rl` renders it, ending with the assistant marker."""
    from k3.rl.rollout import initial_messages

    return render_ids(initial_messages(task), tokenizer, add_generation_prompt=True)[0]


def suite_items(suite: RewardSuite, tokenizer) -> tuple[list[Item], list[Item]]:
    """(train items, held-out items) of the suite's domain, each carrying its task."""
    def items(tasks):
        return [Item(suite.name, task_prompt_ids(task, tokenizer), [], task=task) for task in tasks]

    return items(suite.train), items(suite.heldout)


def single_turn_answer(text: str) -> str | None:
    """The submitted answer of one assistant turn, its text when it calls no tool, None otherwise."""
    calls = parse_tool_calls(text)
    if not calls:
        return text.strip()
    for call in calls:
        if call.name == "submit" and call.error is None:
            return str(call.arguments.get("answer", ""))
    return None


def task_reward(task: Task, completion_ids: list[int], tokenizer) -> float:
    """The verifier's reward in [0, 1] for a single-turn completion (ids, EOS dropped)."""
    eos = tokenizer.eos_token_id
    text = tokenizer.decode([t for t in completion_ids if t != eos])
    return score(task, single_turn_answer(text), None)[0]


def centred_rewards(rewards: list[float], groups: list[int]) -> list[float]:
    """Each reward minus the mean reward of its group (the completions of one prompt): the RL step's "mean"
    group advantage (k3.rl.losses.group_advantages), group by group."""
    members: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    out = [0.0] * len(rewards)
    for indices in members.values():
        centred = group_advantages(torch.tensor([rewards[i] for i in indices], dtype=torch.float64), "mean")
        for i, value in zip(indices, centred.tolist()):
            out[i] = value
    return out
