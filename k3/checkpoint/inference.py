"""A model and tokenizer ready for inference, from a k3 training run or a Hugging Face-format directory: what
`k3 generate / chat / serve / eval` and the RL and distillation trainers load."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from k3.runtime import inference_dtype, resolve_device


def load_for_inference(run: str | None, model_path: str | None, device: str = "auto",
                       dtype: str | None = None) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) from a training run directory / checkpoint file, or from a Hugging Face-format
    directory. dtype (auto | fp32 | bf16): cast the weights for inference and freeze them; None keeps the
    checkpoint's and leaves them trainable (fp32 master weights, for trainers that start from a run)."""
    if (run is None) == (model_path is None):
        raise ValueError("give exactly one of --run DIR (a k3 training run) or --model PATH (a Hugging Face-format "
                         "directory)")
    target = resolve_device(device)  # before loading: a device that does not exist fails at once
    if model_path is not None:
        try:
            from k3.checkpoint.hf_load import from_pretrained
            from k3.data.hf_tokenizer import load_hf_tokenizer
        except ImportError as error:
            raise RuntimeError(f"--model needs the Hugging Face loader k3.checkpoint.hf_load, which is not available "
                               f"({error}); use --run with a k3 training run instead") from error
        model = from_pretrained(model_path)
        tokenizer = load_hf_tokenizer(model_path, required=False)
        if tokenizer is None:
            raise FileNotFoundError(f"{model_path} holds no tokenizer files (tokenizer.json or tiktoken.model); "
                                    f"generation needs one")
    else:
        from k3.checkpoint.run import SHARDED_CHECKPOINT_NAME, load_run_model
        from k3.data.tokenizer import load_tokenizer

        model, state = load_run_model(run)
        inside = Path(run).is_file() or Path(run).name == SHARDED_CHECKPOINT_NAME
        run_dir = Path(run).parent if inside else Path(run)
        if (run_dir / "tokenizer").is_dir():
            tokenizer = load_tokenizer(run_dir / "tokenizer")
        else:
            tokenizer = _tokenizer_inside_checkpoint(state)
    # One move that also casts: moving the fp32 weights first would hold them on the device before the cast.
    model = model.to(target, inference_dtype(dtype, target) if dtype is not None else None)
    if dtype is not None:
        # An inference copy: frozen, so the engine may fuse its projection weights (k3.layers.fused_weights).
        model.requires_grad_(False)
    return model.eval(), tokenizer


def load_trainable(run: str, device: str) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) of a k3 run with its fp32 weights left trainable: where the RL and SFT trainers start."""
    return load_for_inference(run, None, device)


def load_tokenizer_for_inference(run: str | None, model_path: str | None):
    """The tokenizer load_for_inference would give, reading no weights (a server whose engine runs in another
    process tokenizes here): the HF directory's files or the run's tokenizer/; a run whose tokenizer sits only
    inside its checkpoint gets it from the checkpoint's small entries, its tensors left unread."""
    if (run is None) == (model_path is None):
        raise ValueError("give exactly one of --run DIR (a k3 training run) or --model PATH (a Hugging Face-format "
                         "directory)")
    if model_path is not None:
        from k3.data.hf_tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(model_path, required=False)
        if tokenizer is None:
            raise FileNotFoundError(f"{model_path} holds no tokenizer files (tokenizer.json or tiktoken.model); "
                                    f"generation needs one")
        return tokenizer
    from k3.checkpoint.run import SHARDED_CHECKPOINT_NAME, read_run_metadata
    from k3.data.tokenizer import load_tokenizer

    inside = Path(run).is_file() or Path(run).name == SHARDED_CHECKPOINT_NAME
    run_dir = Path(run).parent if inside else Path(run)
    if (run_dir / "tokenizer").is_dir():
        return load_tokenizer(run_dir / "tokenizer")
    return _tokenizer_inside_checkpoint(read_run_metadata(run))


def _tokenizer_inside_checkpoint(state: dict) -> object:
    """The tokenizer stored in a checkpoint's entries, unpacked into a directory of our own that is removed once
    loaded (every tokenizer reads its files whole at load time)."""
    from k3.checkpoint.native import tokenizer_from_checkpoint

    with tempfile.TemporaryDirectory(prefix="k3-tokenizer-") as directory:
        return tokenizer_from_checkpoint(state, directory)
