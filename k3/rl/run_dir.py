"""What `k3 rl` and `k3 distill` share when they open their output directory: resume or refuse to overwrite,
and the policy model from the checkpoint, from Python, or from a source they load themselves."""

from __future__ import annotations

from pathlib import Path

from k3.checkpoint.native import CHECKPOINT_NAME, load_checkpoint, load_model_state
from k3.config import ModelConfig


def open_run(out: Path, resume: bool, key: str, command: str, what: str) -> dict | None:
    """The checkpoint state to continue (resume) or None for a new run. key: the settings entry the command
    writes into its checkpoints; what: how errors name a run of this kind ("an RL run")."""
    checkpoint = out / CHECKPOINT_NAME
    if resume:
        if not checkpoint.is_file():
            raise FileNotFoundError(f"--resume given but {checkpoint} does not exist; start the run without "
                                    f"--resume first")
        state = load_checkpoint(checkpoint)
        if key not in state:
            raise ValueError(f"{checkpoint} was not written by `{command}` (no {key} settings in it)")
        return state
    if checkpoint.exists():
        raise ValueError(f"{out} already holds {what} ({checkpoint}); pass --resume to continue it or choose "
                         f"another --out")
    return None


def policy_from(state: dict | None, out: Path, device, model=None, tokenizer=None):
    """(model, tokenizer) from the resumed state, else the model passed in from Python, else None (the caller
    loads its configured source)."""
    if state is not None:
        from k3.checkpoint.native import tokenizer_from_checkpoint
        from k3.model import K3ForCausalLM

        loaded_tokenizer = tokenizer_from_checkpoint(state, out / "tokenizer")
        loaded = K3ForCausalLM(ModelConfig.from_dict(state["config"]))
        load_model_state(loaded, state["model"], str(out / CHECKPOINT_NAME))
        return loaded.to(device), loaded_tokenizer
    if model is not None:
        if tokenizer is None:
            raise ValueError("a model passed in needs its tokenizer too")
        return model.to(device), tokenizer
    return None


def start_or_restore(out: Path, state: dict | None, optimizer, tokenizer, settings_file: str, settings: dict,
                     model_config: dict) -> int:
    """Resumed (state given): load the optimizer and RNG states and return the saved step. New: write the
    run's tokenizer/, its settings (settings_file, e.g. rl_config.json) and config.json, and return 0."""
    import json

    from k3.atomic import atomic_write_bytes
    from k3.runtime import set_rng_state

    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        return int(state["step"])
    out.mkdir(parents=True, exist_ok=True)
    from k3.chat import attach_chat_format
    from k3.rl.chat_format import chat_format_of

    # The chat format the run trains in is saved with its tokenizer (chat_template.jinja): serve reads it back.
    attach_chat_format(tokenizer, chat_format_of(tokenizer))
    tokenizer.save(out / "tokenizer")
    for name, payload in ((settings_file, settings), ("config.json", model_config)):
        atomic_write_bytes(out / name, (json.dumps(payload, indent=2) + "\n").encode())
    return 0


def save_run(out: Path, model, optimizer, key: str, settings: dict, step: int, extra: dict | None = None) -> None:
    """The run's atomic checkpoint: model, optimizer, model config, the command's settings under `key`, step,
    RNG states and the tokenizer files (what open_run / policy_from / start_or_restore read back); extra:
    more entries of the command's own (k3 rl: its parked partial rollouts)."""
    from k3.checkpoint.native import directory_files, save_checkpoint
    from k3.runtime import rng_state

    save_checkpoint(out / CHECKPOINT_NAME, {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": model.config.to_dict(),
        key: settings, "step": step, "rng": rng_state(), "tokenizer": directory_files(out / "tokenizer"),
        **(extra or {})})
