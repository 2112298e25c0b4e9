"""The run directory every k3 trainer writes (train, sft, rl, distill): opened new or resumed, its settings, model
config and tokenizer, its atomic checkpoint and its metrics.jsonl.

    <settings file>   the trainer's settings (train_config.json, sft_config.json, rl_config.json, ...)
    config.json       the ModelConfig
    tokenizer/        the tokenizer files
    checkpoint.pt     the last good checkpoint (k3.checkpoint.native: written atomically), or with k3 train's
    checkpoint/       checkpoint_format "sharded" a torch.distributed.checkpoint directory
    metrics.jsonl     one JSON per step (cut back to the checkpoint's step on resume); metrics.png the curves

A checkpoint holds model, optimizer, config (the ModelConfig), the settings under the kind's key, step, rng and
tokenizer ({file name: bytes}), plus entries of the trainer's own (k3 train: its data position).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from k3.atomic import atomic_write_bytes
from k3.checkpoint.native import (CHECKPOINT_NAME, directory_files, load_checkpoint, load_model_state,
                                  save_checkpoint)
from k3.checkpoint.run import checkpoint_path, saved_format
from k3.runtime import rng_state, set_rng_state
from k3.train.metrics import MetricsLog

RUN_MARKER = ".k3-run"  # written first into a new k3 train run: what a later attempt may clear is k3's own


@dataclass(frozen=True)
class RunKind:
    """What tells one trainer's runs apart."""
    key: str  # the checkpoint entry holding the settings ("train", "sft", "rl", "distill")
    settings_file: str  # the settings' JSON file in the directory
    command: str  # how errors name the command ("k3 rl")
    what: str  # how errors name a run of this kind ("an RL run")
    sharded: bool = False  # whether a sharded checkpoint/ directory may stand for checkpoint.pt


class RunDirectory:
    """One trainer's run directory (see the module docstring)."""

    def __init__(self, out: str | Path, kind: RunKind) -> None:
        self.out, self.kind = Path(out), kind

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT_NAME

    def saved_format(self) -> str | None:
        """"full" or "sharded" for the finished checkpoint the directory holds, None when it holds none."""
        if self.kind.sharded:
            return saved_format(self.out)
        return "full" if self.checkpoint.is_file() else None

    def open(self, resume: bool) -> dict[str, Any] | None:
        """The checkpoint state to continue (resume), or None for a new run, which must not overwrite one. A
        sharded checkpoint's state holds the run's entries only (the shards load into the parallel model)."""
        found = self.saved_format()
        if not resume:
            if found is not None:
                raise ValueError(f"{self.out} already holds {self.kind.what} ({checkpoint_path(self.out, found)}); "
                                 f"pass --resume to continue it or choose another --out")
            return None
        if found is None:
            kinds = f"{CHECKPOINT_NAME} or a sharded checkpoint/ directory" if self.kind.sharded else CHECKPOINT_NAME
            raise FileNotFoundError(f"--resume given but {self.out} holds no finished checkpoint ({kinds}); start "
                                    f"the run without --resume first")
        if found == "full":
            state = load_checkpoint(self.checkpoint)
        else:
            from k3.distributed.sharded_checkpoint import read_sharded_extra
            state = read_sharded_extra(checkpoint_path(self.out, "sharded"))
            if isinstance(state.get("rng"), str):
                raise ValueError(f"{checkpoint_path(self.out, 'sharded')} keeps its RNG states as a pickle "
                                 "(written by an older k3); k3 no longer unpickles checkpoint metadata")
        if self.kind.key not in state:
            raise ValueError(f"{checkpoint_path(self.out, found)} was not written by `{self.kind.command}` (no "
                             f"{self.kind.key} settings in it)")
        state["saved_format"] = found
        return state

    def check_new(self, leftovers: tuple[str, ...] = ()) -> None:
        """A new run starts in a new or empty directory, or in one an earlier attempt of this command left (its
        `leftovers` directories, made from possibly other settings, are cleared); a directory of anything else
        is refused, so nothing the command did not write is touched."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; give a directory for the run")
        if out.is_dir() and not ((out / RUN_MARKER).is_file() or (out / self.kind.settings_file).is_file()):
            entries = sorted(p.name for p in out.iterdir())
            if entries:
                raise ValueError(f"--out {out} already holds files that {self.kind.command} did not write "
                                 f"({len(entries)} entries, e.g. {entries[:3]}); a new run starts in a new or empty "
                                 f"directory: choose another --out")
        for stale in leftovers:
            if (out / stale).is_dir():
                shutil.rmtree(out / stale)

    def create(self) -> None:
        """The new run's directory, marked as k3's (check_new lets a later attempt clear it)."""
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.out / RUN_MARKER, b"")

    def write_settings(self, settings: dict[str, Any], model_config: dict[str, Any]) -> None:
        """The run's settings file and config.json, each written atomically."""
        for name, payload in ((self.kind.settings_file, settings), ("config.json", model_config)):
            atomic_write_bytes(self.out / name, (json.dumps(payload, indent=2) + "\n").encode("utf-8"))

    def start_or_restore(self, state: dict[str, Any] | None, optimizer, tokenizer, settings: dict[str, Any],
                         model_config: dict[str, Any]) -> int:
        """For a chat-trained model (sft, rl, distill). Resumed (state given): load the optimizer and RNG states
        and return the saved step. New: write the tokenizer, with the chat format the run trains in (serve
        reads it back), the settings and config.json, and return 0."""
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            set_rng_state(state["rng"])
            return int(state["step"])
        from k3.chat import attach_chat_format, load_chat_format

        self.out.mkdir(parents=True, exist_ok=True)
        attach_chat_format(tokenizer, load_chat_format(tokenizer, default="k3"))
        tokenizer.save(self.out / "tokenizer")
        self.write_settings(settings, model_config)
        return 0

    def save(self, model_state: dict, optimizer_state: dict, model_config: dict[str, Any],
             settings: dict[str, Any], step: int, extra: dict[str, Any] | None = None) -> None:
        """The atomic checkpoint (a save that dies half-way leaves the previous one whole), with the RNG states
        of this moment and the tokenizer files; then an older checkpoint of the other kind is removed, so a
        resume cannot find it."""
        save_checkpoint(self.checkpoint, {
            "model": model_state, "optimizer": optimizer_state, "config": model_config, self.kind.key: settings,
            "step": step, **(extra or {}), "rng": rng_state(), "tokenizer": self._tokenizer_files()})
        self.remove_other_format("full")

    def _tokenizer_files(self) -> dict[str, bytes]:
        tokenizer = self.out / "tokenizer"
        return directory_files(tokenizer) if tokenizer.is_dir() else {}

    def remove_other_format(self, kept: str) -> None:
        """One kind of checkpoint per run: after a save of `kept`, the other kind goes."""
        if not self.kind.sharded:
            return
        other = checkpoint_path(self.out, "sharded" if kept == "full" else "full")
        if other.is_dir():
            shutil.rmtree(other)
        elif other.exists():
            other.unlink()

    def saved_step(self) -> int | str:
        """The step of the checkpoint on disk, for messages: "none yet" or "unreadable" where there is none."""
        found = self.saved_format()
        if found is None:
            return "none yet"
        try:
            if found == "sharded":
                from k3.distributed.sharded_checkpoint import read_sharded_extra
                return int(read_sharded_extra(checkpoint_path(self.out, "sharded"))["step"])
            return int(load_checkpoint(self.checkpoint)["step"])
        except (RuntimeError, ValueError, OSError):
            return "unreadable"

    def metrics(self, step: int, resumed: bool, rank: int = 0) -> MetricsLog:
        """metrics.jsonl (metrics.rankN.jsonl for another rank): a resumed run drops the records past its
        checkpoint's step, so the file reads as one unbroken run; a new run starts it empty."""
        name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
        return MetricsLog(self.out / name, keep_through_step=step if resumed else None)


def policy_from(state: dict[str, Any] | None, out: str | Path, device, model=None, tokenizer=None):
    """(model, tokenizer) from the resumed state, else the model passed in from Python, else None (the caller
    loads its configured source)."""
    if state is not None:
        from k3.checkpoint.native import tokenizer_from_checkpoint
        from k3.config import ModelConfig
        from k3.model import K3ForCausalLM

        loaded_tokenizer = tokenizer_from_checkpoint(state, Path(out) / "tokenizer")
        loaded = K3ForCausalLM(ModelConfig.from_dict(state["config"]))
        load_model_state(loaded, state["model"], str(Path(out) / CHECKPOINT_NAME))
        return loaded.to(device), loaded_tokenizer
    if model is not None:
        if tokenizer is None:
            raise ValueError("a model passed in needs its tokenizer too")
        return model.to(device), tokenizer
    return None


@dataclass
class OpenedRun:
    """A chat trainer's run directory, opened (open_run): the state to continue (None: a new run) and the settings
    the run goes on with."""
    directory: RunDirectory
    state: dict[str, Any] | None
    config: Any

    def policy(self, device, model=None, tokenizer=None, *, source: str, needs: str,
               load: Callable[[str, str], tuple]) -> tuple[Any, Any]:
        """(model, tokenizer) on ``device``: the resumed run's, else those passed in from Python, else
        load(source, device) (k3.checkpoint.inference.load_trainable for a k3 run); ValueError ``needs`` (the flag
        to give) when there is no source."""
        policy = policy_from(self.state, self.directory.out, device, model, tokenizer)
        if policy is not None:
            return policy
        if not source:
            raise ValueError(needs)
        return load(source, str(device))


def open_run(kind: RunKind, config: Any, resume: bool, read_saved: Callable[[dict[str, Any]], Any],
             **given: Any) -> OpenedRun:
    """Open ``config.out`` for a chat trainer (sft, rl, distill). New: ``config`` as it is (a finished run there is
    refused). Resumed: the saved settings (``read_saved``, which reads either layout) with ``config.out`` and the
    ``given`` fields (by flat name) that are not None in their place: a longer ``steps``, this session's
    ``time_budget_s``."""
    directory = RunDirectory(config.out, kind)
    state = directory.open(resume)
    if state is not None:
        changes = {name: value for name, value in given.items() if value is not None}
        if changes.get("steps", state["step"]) < state["step"]:
            raise ValueError(f"--steps {changes['steps']} is below the {state['step']} steps this run has done")
        from k3.cli_config import replace_flat
        config = replace_flat(read_saved(state[kind.key]), out=config.out, **changes)
    return OpenedRun(directory, state, config)


def fresh_demo_dir(out: str | Path, marker: str, command: str) -> Path:
    """A demo's output folder made new, holding only ``marker`` (an empty JSON object until the demo writes its
    summary there). An existing ``out`` is deleted only when it holds ``marker`` (an earlier run of the same
    demo); any other existing path is refused, naming ``command``, before anything is written."""
    out_dir = Path(out)
    if out_dir.exists():
        if not (out_dir / marker).is_file():
            raise ValueError(f"{out_dir} exists and was not written by `{command}`; choose another --out")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    atomic_write_bytes(out_dir / marker, b"{}\n")
    return out_dir
