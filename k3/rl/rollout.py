"""Rollouts: many multi-turn tool-use episodes at once, each in its own sandbox.

For every task of a step, one sandbox is prepared (image, setup files, setup command) and snapshotted; the
G episodes of that task start from that ONE snapshot, forked G times, so they see one prepared state and
none sees a sibling's writes. All live episodes generate together: each turn is one batched engine call
over every episode still running (the first turn of a group is one request with n = G: its prompt is
prefilled once). Tool calls then run in the episodes' sandboxes in parallel threads.

An episode ends on submit, on a turn without a tool call (its text is the answer), or at a limit (turns,
total tokens, the engine's context, and wall seconds of its own tool calls: time spent queued for the batched
engine turn or behind other episodes does not count). A sandbox that dies ends its episode as failed (reward 0,
reason kept); the others go on. Partial rollouts (Kimi k1.5): with ``iteration_token_budget`` set, once
the step has generated that many tokens the episodes still running are parked (their tokens kept, their
sandbox snapshotted and closed) and continue in the next call, before any new task starts; their finished
siblings are verified at once. ``parked_state`` / ``restore_parked`` carry parked groups through a
checkpoint: plain data (tokens, counters, the task) plus each parked sandbox's snapshot exported from the
layer store, so a resumed run continues them even on a machine whose store never held those layers.

Per token an episode keeps: ids, whether the policy produced it (tool output, prompts and markers are not
trainable), the engine's logprob (NaN where the engine gives none) and, with an engine that records routing,
the experts it was routed to in every MoE layer (for routing replay of the rollout's own routing).
"""

from __future__ import annotations

import hashlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from k3.cli_config import option
from k3.rl.chat_format import parse_tool_calls, render_ids, tool_message_ids
from k3.rl.generation import generate
from k3.rl.tasks import Task
from k3.rl.tools import SandboxGone, run_tool, tool_list_text, truncate, web_session
from k3.rl.verify import score


@dataclass
class Episode:
    task: Task
    group: int
    sample: int
    ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    prompt_len: int
    sandbox: object | None = None
    parked_snapshot: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    sandbox_calls: int = 0  # tool calls that ran in the sandbox
    model_tokens: int = 0
    answer: str | None = None
    done: bool = False
    finish: str = ""
    reward: float = 0.0
    reason: str = ""
    seconds: float = 0.0
    sandbox_seconds: float = 0.0
    # The episode's own time, which its wall-time limit (limits.seconds) counts: its tool calls running. Not the
    # batched engine turn it waits for with every other live episode, nor their tools: on a slow or busy
    # machine that wait grows with the batch and would turn queueing into reward 0 (token limits bound the
    # episode's generation).
    active_seconds: float = 0.0
    truncated_outputs: int = 0
    failed: bool = False  # the sandbox failed (not the policy): reward 0 without verification
    verified: bool = False  # reward and reason are final
    origin: tuple[int, int] = (0, 0)  # (step, index in that step's tasks): orders groups wherever they ran
    started: float = field(default_factory=time.perf_counter)
    transcript: list[dict] = field(default_factory=list)
    last_output: object | None = None  # the turn just generated (k3.rl.generation.Generated)
    # With an engine that records routing: the experts of every token it fed, [MoE layers, fed, K] (int32),
    # each token's as of the turn that first fed it; the trainer replays them (k3.rl.routing).
    routing: object | None = None
    web: object | None = None  # the offline-web session of a task with web tools (k3.rl.tools.web_session)
    web_state: dict | None = None  # its open page and links, kept through a checkpoint

    @property
    def response_tokens(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass
class RolloutConfig:
    """How episodes are rolled out; each field's docstring is its `k3 rl` --help text."""

    temperature: float = 1.0
    """sampling temperature of the rollouts"""
    top_p: float = 1.0
    """nucleus sampling of the rollouts (1: off)"""
    max_context: int = 4096
    """longest episode (prompt, turns and tool observations), in tokens"""
    tool_budget: int = 2000
    """characters of one tool observation"""
    tool_timeout: float = 20.0
    """seconds one tool call may run"""
    iteration_token_budget: int | None = None
    """partial rollouts: park episodes once a step has generated this many tokens"""
    threads: int = 8
    """threads running the episodes' sandbox calls"""
    keep_transcripts: bool = False
    """keep each episode's messages"""
    # Held-out scoring (run_aside) starts at most this many episodes at once, wave after wave (None: all at
    # once). Each turn is one batched engine call over every live episode, so with thousands live a turn takes
    # minutes on a CPU and every episode runs out of its wall-time limit while it waits for the others: 200
    # tasks x 8 samples at once scored 0.14 where waves of 64 scored 0.74. A wave's episodes start their clocks
    # (and their sandboxes) when the wave starts.
    max_live_episodes: int | None = None
    sandbox_backend: str = field(default="local", metadata=option(choices=("local", "vm")))
    """episode sandboxes: local (namespaces, the default) or vm (microVMs; needs KVM, see docs/sandbox.md)"""


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big") % (2 ** 31)


def system_text(task: Task) -> str:
    return (task.system or "Solve the task with tools, then submit.") + "\nTools:\n" + tool_list_text(task.tools)


def initial_messages(task: Task) -> list[dict]:
    return [{"role": "system", "content": system_text(task)}, {"role": "user", "content": task.prompt}]


def prepare_sandbox(task: Task, limits=None, backend: str = "local"):
    """A sandbox with the task's image, files and setup command run; the caller snapshots and forks it."""
    from k3.sandbox import Sandbox

    box = Sandbox(task.image, limits, backend=backend)
    try:
        for path, text in task.files.items():
            box.write_file(path, text)
        if task.setup:
            result = box.exec(task.setup, timeout=task.limits.seconds)
            if not result.ok:
                raise RuntimeError(f"task {task.id}: setup command failed (exit {result.exit_code}): "
                                   f"{(result.stdout + result.stderr).strip()[-300:]}")
    except BaseException:
        box.close()
        raise
    return box


class RolloutRunner:
    """Runs groups of episodes: ``run(tasks, group_size, step)`` -> finished groups (lists of Episodes).

    engine: the inference engine (see k3.rl.generation); tokenizer: its tokenizer; sandbox_limits: k3.sandbox
    Limits for every episode's sandbox."""

    def __init__(self, engine, tokenizer, config: RolloutConfig | None = None, sandbox_limits=None,
                 seed: int = 0) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.config = config or RolloutConfig()
        self.sandbox_limits = sandbox_limits
        self.seed = seed
        self.parked: list[list[Episode]] = []
        self.stats: dict[str, float] = {}

    # -- set up ------------------------------------------------------------------------------------
    def _start_group(self, task: Task, group: int, size: int, origin: tuple[int, int] = (0, 0)) -> list[Episode]:
        ids, mask = render_ids(initial_messages(task), self.tokenizer, add_generation_prompt=True)
        episodes = [Episode(task, group, s, list(ids), list(mask), [0.0] * len(ids), len(ids), origin=origin)
                    for s in range(size)]
        if len(ids) + 2 > self.config.max_context:
            for episode in episodes:
                self._end(episode, "context", f"the prompt has {len(ids)} tokens, more than the context of "
                                              f"{self.config.max_context} leaves room for")
                episode.failed = True
            return episodes
        started = time.perf_counter()
        # Without a setup command the prepared sandbox runs no process of its own, so it is just what a fork of
        # its snapshot would be: it serves as the first episode's, which saves a sandbox start per group.
        # (The VM backend always forks: its snapshot's memory file is removed once the forks hold it.)
        keep_base = not task.setup and self.config.sandbox_backend != "vm"
        try:
            base = prepare_sandbox(task, self.sandbox_limits, self.config.sandbox_backend)
            forks, snapshot = [], None
            try:
                if size > keep_base:
                    snapshot = base.snapshot()
                    forks = base.fork(snapshot, n=size - keep_base)
            except BaseException:
                base.close()
                raise
            if keep_base:
                forks.insert(0, base)
            else:
                base.close()
                # The VM snapshot is a whole memory file: the forks hold it open, nothing else needs it.
                if self.config.sandbox_backend == "vm" and snapshot is not None:
                    base.store.remove(snapshot)
            for episode, box in zip(episodes, forks):
                episode.sandbox = box
        except Exception as error:  # a task that cannot be prepared fails its own group only
            for episode in episodes:
                self._end(episode, "sandbox_failed", f"could not prepare the sandbox: {type(error).__name__}: {error}")
        spent = time.perf_counter() - started
        for episode in episodes:
            episode.sandbox_seconds += spent / size
        return episodes

    def _unpark(self, episode: Episode) -> None:
        from k3.sandbox import Sandbox

        if episode.done or episode.parked_snapshot is None:
            episode.parked_snapshot = None
            return
        try:
            episode.sandbox = Sandbox(episode.task.image, self.sandbox_limits, snapshot=episode.parked_snapshot,
                                      backend=self.config.sandbox_backend)
        except Exception as error:
            self._end(episode, "sandbox_failed", f"could not restore the parked sandbox: {error}")
        episode.parked_snapshot = None

    # -- the loop ----------------------------------------------------------------------------------
    def run_aside(self, tasks: list[Task], group_size: int, step: int, temperature: float,
                  indices: list[int] | None = None) -> list[list[Episode]]:
        """``run`` at another temperature and without the token budget, leaving the parked groups where they
        are (held-out scoring between training steps); in waves of at most ``max_live_episodes`` episodes."""
        config = self.config
        indices = list(indices) if indices is not None else list(range(len(tasks)))
        per_wave = max(1, len(tasks) if config.max_live_episodes is None else config.max_live_episodes // group_size)
        saved = config.temperature, config.iteration_token_budget, self.parked
        config.temperature, config.iteration_token_budget, self.parked = temperature, None, []
        groups, totals = [], {}
        try:
            for start in range(0, max(len(tasks), 1), per_wave):
                groups += self.run(tasks[start:start + per_wave], group_size, step, indices[start:start + per_wave])
                for key, value in self.stats.items():
                    totals[key] = totals.get(key, 0) + value
        finally:
            config.temperature, config.iteration_token_budget, self.parked = saved
        if totals.get("generation_s"):
            totals["rollout_tokens_per_s"] = totals["generated_tokens"] / totals["generation_s"]
        self.stats = totals
        return groups

    def run(self, tasks: list[Task], group_size: int, step: int = 0,
            indices: list[int] | None = None) -> list[list[Episode]]:
        """Parked groups first, then one group of ``group_size`` per task; returns the groups whose episodes
        all finished (a group with a parked episode waits for the next call). indices: where ``tasks`` stand
        in the step's task list (a worker given a share of them), for the groups' origin."""
        config = self.config
        started = time.perf_counter()
        groups = self.parked
        self.parked = []
        for group in groups:
            for episode in group:
                self._unpark(episode)
        first_group = len(groups)
        origins = [(step, index) for index in (indices if indices is not None else range(len(tasks)))]
        with ThreadPoolExecutor(max_workers=max(1, min(config.threads, len(tasks) or 1))) as threads:
            groups += list(threads.map(lambda i: self._start_group(tasks[i], first_group + i, group_size, origins[i]),
                                       range(len(tasks))))
        sandbox_setup = time.perf_counter() - started
        generated_tokens, generation_s, tool_s, turn = 0, 0.0, 0.0, 0
        episodes = [e for group in groups for e in group]
        parked = False
        while True:
            live = [e for e in episodes if not e.done]
            if not live:
                break
            if config.iteration_token_budget is not None and generated_tokens >= config.iteration_token_budget:
                parked = True
                break
            t0 = time.perf_counter()
            self._generate_turn(live, step, turn)
            generation_s += time.perf_counter() - t0
            generated_tokens += sum(len(e.last_output.token_ids) for e in live)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=max(1, min(config.threads, len(live)))) as threads:
                list(threads.map(self._act, live))
            tool_s += time.perf_counter() - t0
            turn += 1
        finished, waiting = [], []
        for group in groups:
            (waiting if any(not e.done for e in group) else finished).append(group)
        t0 = time.perf_counter()
        if parked:
            for group in waiting:
                for episode in group:
                    if not episode.done:
                        self._park(episode)
            self.parked = waiting
        # Finished episodes of parked groups are verified now too: no sandbox is held across calls.
        to_verify = [e for g in finished + waiting for e in g if e.done and not e.verified]
        with ThreadPoolExecutor(max_workers=max(1, config.threads)) as threads:
            list(threads.map(self._verify, to_verify))
        verify_s = time.perf_counter() - t0
        self.stats = {"generation_s": generation_s, "tool_s": tool_s, "sandbox_setup_s": sandbox_setup,
                      "verify_s": verify_s, "generated_tokens": generated_tokens,
                      "rollout_tokens_per_s": generated_tokens / generation_s if generation_s > 0 else 0.0,
                      "parked_groups": len(self.parked), "rollout_s": time.perf_counter() - started}
        return finished

    def _generate_turn(self, live: list[Episode], step: int, turn: int) -> None:
        config = self.config
        prompts, budgets, seeds, sizes = [], [], [], []
        index = 0
        while index < len(live):
            episode = live[index]
            # A group whose members all stand at their shared prompt goes as one request (n = group size).
            run = 1
            if episode.turns == 0:
                while (index + run < len(live) and live[index + run].group == episode.group
                       and live[index + run].turns == 0 and live[index + run].ids == episode.ids):
                    run += 1
            limits = episode.task.limits
            budget = min(limits.tokens_per_turn, limits.total_tokens - episode.model_tokens,
                         config.max_context - len(episode.ids) - 1)
            for member in live[index:index + run]:
                prompts.append(member.ids)
                budgets.append(max(budget, 1))
                seeds.append(_seed(self.seed, step, member.task.id, member.sample, member.turns))
            sizes.append(run)
            index += run
        outputs = generate(self.engine, prompts, budgets, config.temperature, config.top_p, seeds, [], sizes)
        for episode, out in zip(live, outputs):
            if out.routing is not None:
                self._add_routing(episode, out.routing)
            episode.ids.extend(out.token_ids)
            episode.mask.extend([True] * len(out.token_ids))
            episode.logprobs.extend(out.logprobs if out.logprobs is not None else [math.nan] * len(out.token_ids))
            episode.model_tokens += len(out.token_ids)
            episode.turns += 1
            episode.last_output = out

    @staticmethod
    def _web(episode: Episode):
        if episode.web is None:
            episode.web = web_session(episode.task.tools)
            if episode.web is not None and episode.web_state:
                episode.web.url, episode.web.links = episode.web_state["url"], list(episode.web_state["links"])
        return episode.web

    @staticmethod
    def _add_routing(episode: Episode, routing) -> None:
        """Keep the rows of tokens fed for the first time this turn (the observation after the last turn, the
        last token of that turn, and this turn's new tokens but its last)."""
        import torch

        fed = 0 if episode.routing is None else episode.routing.shape[1]
        if routing.shape[1] <= fed:
            return
        new = routing[:, fed:].to(torch.int32)
        episode.routing = new if episode.routing is None else torch.cat([episode.routing, new], 1)

    def _act(self, episode: Episode) -> None:
        """Parse the turn just generated, run its tool calls, append the observations, check the limits."""
        out = episode.last_output
        eos = self.tokenizer.eos_token_id
        text = self.tokenizer.decode([t for t in out.token_ids if t != eos])
        if self.config.keep_transcripts:
            episode.transcript.append({"role": "assistant", "content": text})
        calls = parse_tool_calls(text)
        limits = episode.task.limits
        if not calls:
            episode.answer = text.strip()
            self._end(episode, "answered" if out.finish_reason == "stop" else "length")
            return
        observations = []
        for call in calls:
            episode.tool_calls += 1
            try:
                observation = run_tool(call, episode.sandbox, episode.task.tools, self.config.tool_budget,
                                       self.config.tool_timeout, web=self._web(episode))
            except SandboxGone as error:
                self._end(episode, "sandbox_died", f"the sandbox died during {call.name or 'a tool call'}: {error}")
                return
            episode.sandbox_seconds += observation.seconds
            episode.active_seconds += observation.seconds
            episode.sandbox_calls += observation.ran
            episode.tool_errors += observation.is_error
            episode.truncated_outputs += observation.truncated
            if observation.submitted is not None:
                episode.answer = observation.submitted
                self._end(episode, "submitted")
                return
            observations.append(observation.text if len(calls) == 1 else f"[{call.name or 'error'}] {observation.text}")
        content, _ = truncate("\n".join(observations), self.config.tool_budget)
        if self.config.keep_transcripts:
            episode.transcript.append({"role": "tool", "content": content})
        if episode.turns >= limits.turns:
            return self._end(episode, "max_turns")
        if episode.model_tokens >= limits.total_tokens:
            return self._end(episode, "total_tokens")
        observation_ids = tool_message_ids(content, self.tokenizer)
        if len(episode.ids) + len(observation_ids) + 1 >= self.config.max_context:
            return self._end(episode, "context")
        episode.ids.extend(observation_ids)
        episode.mask.extend([False] * len(observation_ids))
        episode.logprobs.extend([0.0] * len(observation_ids))
        if episode.active_seconds > limits.seconds:
            self._end(episode, "time", f"the episode's tool calls ran past its {limits.seconds} s")

    @staticmethod
    def _end(episode: Episode, finish: str, reason: str = "") -> None:
        episode.done, episode.finish = True, finish
        episode.seconds = time.perf_counter() - episode.started
        if reason:
            episode.reason = reason
        if finish in ("sandbox_died", "sandbox_failed"):
            episode.reward = 0.0
            episode.failed = True

    def _park(self, episode: Episode) -> None:
        try:
            episode.parked_snapshot = episode.sandbox.snapshot()
        except Exception as error:
            self._end(episode, "sandbox_died", f"could not park the sandbox: {error}")
        self._close(episode)

    def _verify(self, episode: Episode) -> None:
        episode.verified = True
        if episode.failed:
            self._close(episode)
            return
        t0 = time.perf_counter()
        episode.reward, reason = score(episode.task, episode.answer, episode.sandbox)
        episode.reason = episode.reason or reason
        episode.sandbox_seconds += time.perf_counter() - t0
        self._close(episode)

    @staticmethod
    def _close(episode: Episode) -> None:
        if episode.sandbox is not None:
            try:
                episode.sandbox.close()
            except Exception:
                pass
            episode.sandbox = None

    def close(self) -> None:
        """Forget parked episodes (their snapshots stay in the layer store until its GC)."""
        self.parked = []

    # -- checkpoints -------------------------------------------------------------------------------
    def parked_state(self) -> dict:
        """The parked groups as plain data for a checkpoint: {"groups": [[episode state]], "snapshots":
        {snapshot id: the snapshot with its parent layers, exported from this machine's layer store}}."""
        groups = [[episode_state(e) for e in group] for group in self.parked]
        snapshots = {}
        for group in self.parked:
            for episode in group:
                if episode.parked_snapshot is not None and episode.parked_snapshot not in snapshots:
                    snapshots[episode.parked_snapshot] = export_snapshot(episode.parked_snapshot)
        return {"groups": groups, "snapshots": snapshots}

    def restore_parked(self, state: dict | None) -> None:
        """Take back parked groups from ``parked_state`` (possibly written on another machine): their
        snapshots are imported into this machine's layer store, and the next ``run`` continues them."""
        if not state:
            return
        for exported in state.get("snapshots", {}).values():
            import_snapshot(exported)
        self.parked = [[episode_from_state(e) for e in group] for group in state.get("groups", [])]


_TRANSIENT = ("sandbox", "last_output", "started", "task", "web")


def task_state(task: Task) -> dict:
    import dataclasses

    return dataclasses.asdict(task)


def task_from_state(data: dict) -> Task:
    from k3.rl.tasks import EpisodeLimits, Verifier

    fields = dict(data)
    fields["verifier"] = Verifier(**fields["verifier"])
    fields["limits"] = EpisodeLimits(**fields["limits"])
    fields["tools"] = tuple(fields["tools"]) if fields.get("tools") is not None else None
    return Task(**fields)


def episode_state(episode: Episode) -> dict:
    """An episode between turns as plain data (no sandbox: a parked one names its snapshot)."""
    import dataclasses

    if episode.sandbox is not None:
        raise ValueError(f"episode {episode.task.id}/{episode.sample} still holds a live sandbox; park it first")
    data = {f.name: getattr(episode, f.name) for f in dataclasses.fields(episode) if f.name not in _TRANSIENT}
    data["task"] = task_state(episode.task)
    if episode.web is not None:
        data["web_state"] = {"url": episode.web.url, "links": list(episode.web.links)}
    data["elapsed"] = time.perf_counter() - episode.started  # the wall-time limit counts on after a resume
    return data


def episode_from_state(data: dict) -> Episode:
    fields = dict(data)
    elapsed = fields.pop("elapsed", 0.0)
    fields["task"] = task_from_state(fields["task"])
    episode = Episode(**fields)
    episode.started = time.perf_counter() - elapsed
    return episode


def export_snapshot(snapshot: str) -> dict:
    """A snapshot of this machine's layer store with its parent layers (and memory images, if any), as a
    picklable dict (the form k3.sandbox's RayFleet ships between nodes)."""
    from k3.sandbox import memory
    from k3.sandbox.layers import LayerStore
    from k3.sandbox.paths import scratch_dir

    store = LayerStore(scratch_dir())
    exported = store.export(snapshot)
    exported["memory"] = memory.export_images(store.home, store.chain(snapshot))
    return exported


def import_snapshot(exported: dict) -> str:
    """Store an exported snapshot in this machine's layer store (layers it has already are kept)."""
    from k3.sandbox import memory
    from k3.sandbox.layers import LayerStore
    from k3.sandbox.paths import scratch_dir

    store = LayerStore(scratch_dir())
    memory.import_images(store.home, exported.get("memory", {}))
    return store.import_(exported)
