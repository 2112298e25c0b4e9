"""Helpers of the server tests: a tiny run directory, and `k3 serve` as a subprocess that is always stopped."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

TEXT = "\n".join(f"print('line {i}: {w}')" for i, w in enumerate(["héllo", "wörld", "ça va", "你好", "🙂"] * 12))


def make_run(directory: Path, seed: int = 0) -> Path:
    """A run directory `k3 serve --run` reads: checkpoint.pt (debug preset, random weights) + tokenizer/.
    The tokenizer names no EOS token, so every generation runs to its max_tokens (a random model would stop
    wherever it happened to sample EOS); stop tokens are tested with stop_token_ids."""
    from k3.checkpoint.native import save_checkpoint
    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.model import K3ForCausalLM

    tokenizer = train_bpe([TEXT] * 4, vocab_size=300, show_progress=False)
    config = ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)
    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(directory / "checkpoint.pt", {"config": config.to_dict(), "model": model.state_dict(),
                                                  "step": 0})
    tokenizer.save(directory / "tokenizer")
    config_file = directory / "tokenizer" / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "eos_token": None}))
    return directory


def make_hf_model(run: Path, directory: Path, chat_template: str) -> Path:
    """The run as a Hugging Face-format directory (`k3 serve --model`), with a chat_template.jinja."""
    from k3.checkpoint.hf import save_pretrained
    from k3.infer.cli import load_for_inference

    model, tokenizer = load_for_inference(str(run), None, "cpu")
    save_pretrained(model, tokenizer, directory, format="kimi_k3", progress=False)
    (directory / "chat_template.jinja").write_text(chat_template)
    return directory


class Server:
    """`k3 serve` on a free loopback port (--port 0; the address is read from its first line).
    source: a run directory (--run), or with hf=True a Hugging Face-format directory (--model)."""

    def __init__(self, source: Path, *args: str, hf: bool = False, start_timeout_s: float = 120.0,
                 module: str = "k3", wait: bool = True) -> None:
        """wait=False returns once the process is started; ready() then waits for it (several servers start
        side by side: each start-up is seconds of imports on one core)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        # module: "k3", or a module of this folder standing in for it (dying_serve)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        command = [sys.executable, "-m", module, "serve", "--model" if hf else "--run", str(source), "--port", "0",
                   "--device", "cpu", "--served-model-name", "tiny", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env)
        self.lines: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        self.url = None
        self.http = None
        self._start_timeout_s = start_timeout_s
        self._deadline = time.monotonic() + start_timeout_s
        if wait:
            self.ready()

    def ready(self) -> "Server":
        """Wait until the server listens and its warm-up is over; returns the server."""
        if self.http is not None:
            return self
        start_timeout_s, deadline = self._start_timeout_s, self._deadline
        try:
            while self.url is None:
                try:
                    line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(f"k3 serve did not start in {start_timeout_s} s:\n{self.log()}") from None
                if line is None:
                    raise RuntimeError(f"k3 serve exited with {self.process.wait()}:\n{self.log()}")
                if line.startswith("k3 serve:") and " on http://" in line:
                    self.url = line.split(" on ", 1)[1].split()[0]
        except BaseException:
            self.stop()
            raise
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        # The server listens before its warm-up ends (/health: 503 "warming up"); tests start once it is over.
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if self.health().get("status") != "warming up":
                    break
            except (httpx.HTTPError, ValueError):  # a server that died or answers no JSON: its test will say
                break
            time.sleep(0.05)
        if self.process.poll() is not None:  # it listened, then exited (a failed warm-up): say why, with its log
            self._drainer.join(timeout=10)
            raise RuntimeError(f"k3 serve exited with {self.process.returncode} before it was ready:\n{self.log()}")
        return self

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def log(self) -> str:
        return "".join(self.lines[-50:])

    def health(self) -> dict:
        return self.http.get("/health").json()

    def wait_until(self, predicate, what: str, timeout_s: float = 20.0) -> dict:
        """Poll /health until predicate(health) holds; fail after timeout_s saying what was awaited."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.health()
            if predicate(health):
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen in {timeout_s} s; /health says {health}")
            time.sleep(0.05)

    def wait_idle(self, timeout_s: float = 20.0) -> dict:
        return self.wait_until(lambda h: h["running"] == h["waiting"] == h["in_flight"] == 0
                               and h["kda_slots_used"] == 0 and h["mla_pages_used"] == 0,
                               "requests, slots and pages returning to zero", timeout_s)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the server and wait for it; kill it if it does not exit in time. Returns its exit code."""
        if getattr(self, "http", None) is not None:
            self.http.close()
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        return self.process.returncode
