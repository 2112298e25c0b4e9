"""Careless input to the `k3` commands gives a message naming the flag or file, never a traceback: one
property per test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from k3.checkpoint import native
from k3.cli import main
from k3.config import ModelConfig
from k3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with a debug-preset checkpoint and a tokenizer."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "infer"))
    from server_helpers import make_run

    return make_run(tmp_path_factory.mktemp("careless") / "run")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_names_the_flag(run, capsys):
    assert main(["generate", "--run", str(run), "--prompt", "x", "--device", "cuda"]) == 1
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


def test_a_context_too_large_to_allocate_names_the_flags(run, capsys):
    assert main(["generate", "--run", str(run), "--prompt", "x", "--device", "cpu",
                 "--max-context", str(10**15)]) == 1
    err = capsys.readouterr().err
    assert "lower --max-context or --max-batch" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, words", [(["--n", "0"], "--n must be >= 1"),
                                          (["--ppl-windows", "0", "--perplexity"], "--ppl-windows must be >= 1"),
                                          (["--lengths", "1e300"], "the most k3 eval takes"),
                                          (["--lengths", "1e400"], "cannot read length")])
def test_eval_flags_out_of_range_are_refused(run, capsys, flags, words):
    assert main(["eval", "--run", str(run), "--device", "cpu", *flags]) == 1
    assert words in capsys.readouterr().err


def test_random_bytes_as_training_text_are_refused(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_bytes(torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0),
                                                   dtype=torch.uint8).numpy().tobytes())
    assert main(["train", "--preset", "debug", "--out", str(tmp_path / "r"), "--data", str(data)]) == 1
    assert "does not look like text" in capsys.readouterr().err


def test_chat_takes_binary_stdin_without_a_traceback(run):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "k3", "chat", "--run", str(run), "--device", "cpu",
                           "--max-new-tokens", "2", "--temperature", "0"],
                          input=b"\xff\xfe\x00 h\xc3llo \xed\xa0\x80\n", capture_output=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert b"Traceback" not in done.stderr


def test_an_unwritable_output_is_a_message(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    native.save_checkpoint(tmp_path / "run" / "checkpoint.pt",
                           {"model": model.state_dict(), "config": model.config.to_dict(), "step": 0})
    # --to under a file: its directory cannot be made; the OS's reason is printed with the path.
    assert main(["convert", "--from", str(tmp_path / "run"), "--to", str(tmp_path / "file" / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("k3: error: ") and str(tmp_path / "file") in err


class _FailingAllocation:
    """torch, except that arange fails as a GPU out of memory does (raised from torch's C++, no Python frame)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def arange(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB.")


def test_an_error_k3_did_not_raise_names_the_line_of_k3_it_came_from(run, capsys, monkeypatch):
    import k3.infer.cache_pool as cache_pool

    monkeypatch.setattr(cache_pool, "torch", _FailingAllocation())
    assert main(["generate", "--run", str(run), "--prompt", "x", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("k3: error: CUDA out of memory. Tried to allocate 48.00 GiB. (at k3/infer/cache_pool.py:")
    assert "in _write)" in err and "Traceback" not in err  # the prefill writing its latents to the pages


def test_k3s_own_errors_keep_their_message_alone(run, capsys):
    assert main(["eval", "--run", str(run), "--device", "cpu", "--n", "0"]) == 1
    err = capsys.readouterr().err
    assert "--n must be >= 1" in err and "(at k3/" not in err


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_whole_traceback_on_request(run, capsys, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("K3_TRACEBACK", "1")
    argv = ["eval", "--run", str(run), "--device", "cpu", "--n", "0"]
    assert main(["--traceback", *argv] if how == "flag" else argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("k3: error: ")
