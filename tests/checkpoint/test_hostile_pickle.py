"""A checkpoint from elsewhere is data, never code: a pickle whose `__reduce__` would create a marker file is
refused by every loader and every command that loads one, with a message saying why, and the marker never
appears."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from k3.checkpoint.native import CHECKPOINT_FORMAT, UnsafeCheckpointError, load_checkpoint
from k3.cli import main
from k3.distributed import checkpoint as full_checkpoint
from k3.distributed.sharded_checkpoint import FORMAT as SHARDED_FORMAT
from k3.distributed.sharded_checkpoint import METADATA_NAME, read_sharded_extra


class MarkerPayload:
    """Unpickling this opens (so creates) `path`: what a hostile checkpoint would do with os.system."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _hostile_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory whose checkpoint.pt looks like k3's but carries the payload. Returns (run, marker)."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    run.mkdir()
    torch.save({"format": CHECKPOINT_FORMAT, "model": {}, "config": {}, "step": 0, "payload": MarkerPayload(marker)},
               run / "checkpoint.pt")
    return run, marker


def test_the_payload_works_when_unpickled(tmp_path):
    # The control: the same file run through a full unpickle does create the marker, so the tests below can fail.
    run, marker = _hostile_run(tmp_path)
    torch.load(run / "checkpoint.pt", weights_only=False)
    assert marker.exists()


def test_native_loader_refuses_the_payload(tmp_path):
    run, marker = _hostile_run(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="could run code"):
        load_checkpoint(run)
    assert not marker.exists()


def test_full_state_dict_loader_refuses_the_payload(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"format": full_checkpoint.FORMAT, "model": {}, "payload": MarkerPayload(marker)}, tmp_path / "m.pt")
    with pytest.raises(pickle.UnpicklingError):
        full_checkpoint.load_checkpoint(torch.nn.Linear(2, 2), tmp_path / "m.pt")
    assert not marker.exists()


def _sharded_run(tmp_path: Path, extra_json) -> Path:
    """A run directory with a sharded checkpoint/ of a tiny Linear, its `k3` entry set to extra_json."""
    run = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    dcp.save({"model": model.state_dict(), "k3": {"format": SHARDED_FORMAT, "extra_json": extra_json}},
             checkpoint_id=str(run / "checkpoint"), no_dist=True)
    return run


def test_sharded_index_with_a_payload_is_refused(tmp_path):
    run, marker = _sharded_run(tmp_path, json.dumps({"config": {}})), tmp_path / "marker"
    (run / "checkpoint" / METADATA_NAME).write_bytes(pickle.dumps(MarkerPayload(marker)))
    with pytest.raises(UnsafeCheckpointError, match="could run code"):
        read_sharded_extra(run / "checkpoint")
    assert not marker.exists()


def test_sharded_entry_with_a_payload_is_refused(tmp_path):
    marker = tmp_path / "marker"
    run = _sharded_run(tmp_path, MarkerPayload(marker))
    assert not marker.exists()  # saving pickles the payload; only unpickling would run it
    with pytest.raises(UnsafeCheckpointError, match="other than tensors"):
        read_sharded_extra(run / "checkpoint")
    assert not marker.exists()


COMMANDS = {
    "generate": lambda run, tmp: ["generate", "--run", str(run), "--prompt", "hi", "--device", "cpu"],
    "chat": lambda run, tmp: ["chat", "--run", str(run), "--device", "cpu"],
    "eval": lambda run, tmp: ["eval", "--run", str(run), "--device", "cpu", "--lengths", "64", "--n", "1"],
    "convert": lambda run, tmp: ["convert", "--from", str(run), "--to", str(tmp / "converted")],
    "serve": lambda run, tmp: ["serve", "--run", str(run), "--device", "cpu", "--port", "0"],
    "train --resume": lambda run, tmp: ["train", "--out", str(run), "--resume"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_refuse_a_hostile_checkpoint(tmp_path, capsys, command):
    run, marker = _hostile_run(tmp_path)
    assert main(COMMANDS[command](run, tmp_path)) == 1
    assert "could run code" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_commands_refuse_a_hostile_sharded_index(tmp_path, capsys, command):
    run, marker = _sharded_run(tmp_path, json.dumps({"config": {}})), tmp_path / "marker"
    (run / "checkpoint" / METADATA_NAME).write_bytes(pickle.dumps(MarkerPayload(marker)))
    assert main(COMMANDS[command](run, tmp_path)) == 1
    assert "could run code" in capsys.readouterr().err
    assert not marker.exists()
