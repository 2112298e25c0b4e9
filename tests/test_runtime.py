"""k3.runtime: the device and dtype choices every command shares, seeding, and RNG states in checkpoints' plain
form (JSON-able, loadable with weights_only=True)."""

import json
import random

import numpy as np
import pytest
import torch

from k3.runtime import (autocast_dtype, inference_dtype, resolve_device, rng_state, seed_everything,
                        set_rng_state)


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_rng_state_round_trips_through_json_and_replays_every_generator():
    seed_everything(7)
    saved = json.loads(json.dumps(rng_state()))  # the plain form survives JSON as is
    first = draws()
    draws()
    set_rng_state(saved)
    assert draws() == first
    seed_everything(7)
    assert draws() == first  # seeding sets torch, numpy and python alike


def test_a_non_plain_rng_state_is_refused_with_the_converter_named():
    state = rng_state()
    state["numpy"] = np.random.get_state()
    with pytest.raises(ValueError, match="plain_rng_state"):
        set_rng_state(state)


def test_device_and_dtype_choices():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("tpu:x")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    assert autocast_dtype("auto", torch.device("cpu")) is None  # fp32 on CPU
    assert autocast_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert inference_dtype("auto", "cpu") == torch.float32
    with pytest.raises(ValueError, match="auto, fp32 or bf16"):
        autocast_dtype("fp16", torch.device("cpu"))
