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
