"""Where and in what precision k3 runs, and its random state: the device and dtype choices every command shares
(`--device`, `--dtype`), the CPU threads a demo takes, seeding, and every RNG's state in a plain form that
checkpoints carry."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

DTYPE_CHOICES = ("auto", "fp32", "bf16")
DTYPE_HELP = ("weights and activations: auto = bf16 on a CUDA device with bf16 support (the grouped-GEMM MoE and "
              "CUDA-graph decode need it), fp32 elsewhere")


def resolve_device(name: str) -> torch.device:
    """`--device` as a torch.device (auto: CUDA when torch sees one, else CPU); ValueError for one this machine
    lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r} is not a device ({error}); use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available to torch here; use --device cpu "
                             f"(or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0")
    return device


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32. bf16 on CPU is slower than fp32 on most CPUs, so auto keeps
    fp32 there."""
    if name == "fp32":
        return None
    if name == "bf16":
        return torch.bfloat16
    if name != "auto":
        raise ValueError(f"dtype must be auto, fp32 or bf16, got {name!r}")
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def rng_state() -> dict[str, Any]:
    """Every RNG's state as plain lists and numbers: it loads with weights_only=True and goes into JSON as is."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return plain_rng_state(state)


def plain_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    """RNG states as torch / numpy / random return them ({"torch": ByteTensor, "numpy": (kind, keys, pos,
    has_gauss, gauss), "python": (version, internal, gauss_next)}) -> the plain form set_rng_state takes."""
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    version, internal, gauss_next = state["python"]
    plain = {"torch": [int(b) for b in state["torch"].tolist()],
             "numpy": {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "python": {"version": int(version), "internal": [int(i) for i in internal], "gauss_next": gauss_next}}
    if "cuda" in state:
        plain["cuda"] = [[int(b) for b in s.tolist()] for s in state["cuda"]]
    return plain


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore every RNG from rng_state()'s plain form (a CUDA state only where CUDA is available)."""
    if not isinstance(state.get("numpy"), dict):
        raise ValueError("the checkpoint's RNG states are not in k3's plain form (a checkpoint of an older k3?); "
                         "convert them with k3.runtime.plain_rng_state")
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], np.array(numpy_state["keys"], dtype=np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def inference_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The dtype a served/evaluated model runs in: `--dtype` resolved for the device (auto: bf16 on CUDA)."""
    return autocast_dtype(name, torch.device(device)) or torch.float32


def seed_everything(seed: int) -> None:
    """Seed torch (every device), numpy's and python's global RNGs."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def idle_cores() -> int:
    """Cores not already busy, from the 1-minute load average. Oversubscribed OpenMP threads spin-wait on
    each other and run many times slower than one thread, so a busy machine gets fewer threads."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return max(1, min(cores, int(cores - load + 0.5)))
