"""Supervised warm start: fine-tune on chat-formatted trajectories (k3.rl.demos), loss on assistant tokens only.

Examples are rendered with k3.rl.chat_format (the same ids RL samples), packed into one row per step
(cu_seqlens: no attention across examples), and trained with AdamW under the trainer's warmup + cosine
schedule. The run directory is laid out as `k3 train`'s (checkpoint.pt with model, optimizer, config,
step, RNG and tokenizer; config.json; tokenizer/; metrics.jsonl), so `k3 rl --run` and `k3 generate --run`
read it. Resume is exact: the examples of a step follow from (seed, step).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from k3.data.packing import filler_length
from k3.rl.chat_format import render_ids
from k3.rl.demos import read_demonstrations
from k3.rl.run_dir import open_run, policy_from, save_run, start_or_restore
from k3.runtime import autocast_dtype, resolve_device
from k3.train.metrics import MetricsLog
from k3.train.optim import build_optimizer, lr_at


@dataclass
class SFTConfig:
    run: str = ""  # the starting checkpoint (a run directory); empty when a model is passed in from Python
    data: str = ""  # demonstrations JSONL
    out: str = "runs/sft"
    steps: int = 200
    batch_size: int = 16  # examples per step
    lr: float = 1e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_tokens: int = 2048  # longer examples are cut
    seed: int = 0
    save_every: int = 100
    device: str = "auto"
    # Packed batches padded to a multiple of this many tokens (a filler document with ignored labels), so the
    # GPU kernels meet a few lengths instead of a new one every step. None: PACK_MULTIPLE_CUDA on CUDA, 0 else.
    # The filler's tokens do pass the routers, so they count in the loads the MoE balancer sees.
    pack_multiple: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sft_rows(messages: list[dict], tokenizer, max_tokens: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of one example: labels[t] is ids[t+1] where that token is an assistant token, else -100
    (the model's loss takes labels aligned with its logits, no shift inside)."""
    ids, mask = render_ids(messages, tokenizer)
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    labels = [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
    return ids, labels


class SFTTrainer:
    def __init__(self, config: SFTConfig, resume: bool = False, model=None, tokenizer=None,
                 log: Callable[[str], None] = print, show_progress: bool = True,
                 steps_override: int | None = None) -> None:
        """resume: continue DIR/checkpoint.pt with its saved settings (``steps_override`` may extend it)."""
        self.log, self.show_progress = log, show_progress
        self.out = Path(config.out)
        state = open_run(self.out, resume, "sft", "k3 sft", "an SFT run")
        if state is not None:
            saved = SFTConfig(**state["sft"])
            config = dataclasses.replace(saved, out=config.out, steps=steps_override or saved.steps)
        self.config = config
        self.device = resolve_device(config.device)
        self.autocast = autocast_dtype("auto", self.device)
        torch.manual_seed(config.seed)
        policy = policy_from(state, self.out, self.device, model, tokenizer)
        if policy is not None:
            model, tokenizer = policy
        else:
            if not config.run:
                raise ValueError("give the starting checkpoint: --run DIR (a `k3 train` run)")
            from k3.checkpoint.inference import load_for_inference

            model, tokenizer = load_for_inference(config.run, None, str(self.device))
        if tokenizer is None:
            raise ValueError("SFT needs the model's tokenizer")
        self.model, self.tokenizer = model.to(self.device), tokenizer
        self.examples = [sft_rows(m, tokenizer, config.max_tokens) for m in read_demonstrations(config.data)]
        self.optimizer = build_optimizer(self.model, config.lr, config.weight_decay)
        self.step = start_or_restore(self.out, state, self.optimizer, tokenizer, "sft_config.json",
                                     config.to_dict(), model.config.to_dict())
        self.metrics = MetricsLog(self.out / "metrics.jsonl", keep_through_step=self.step if resume else None)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [1, total], labels [1, total], cu_seqlens [n+1]) of step ``step``'s examples."""
        rng = random.Random(f"{self.config.seed}/{step}")
        chosen = [rng.randrange(len(self.examples)) for _ in range(self.config.batch_size)]
        ids = [t for i in chosen for t in self.examples[i][0]]
        labels = [t for i in chosen for t in self.examples[i][1]]
        lengths = [len(self.examples[i][0]) for i in chosen]
        filler = filler_length(len(ids), self.config.pack_multiple, self.device)
        if filler:
            ids += [self.tokenizer.eos_token_id] * filler
            labels += [-100] * filler
            lengths.append(filler)
        lengths = torch.tensor(lengths)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
        return (torch.tensor([ids], device=self.device), torch.tensor([labels], device=self.device),
                cu.to(self.device))

    def save(self) -> None:
        save_run(self.out, self.model, self.optimizer, "sft", self.config.to_dict(), self.step)

    def train(self, stop_at: int | None = None) -> dict[str, Any]:
        config = self.config
        self.model.train()
        first = None
        bar = tqdm(total=config.steps, initial=self.step, desc="sft", unit="step", disable=not self.show_progress,
                   dynamic_ncols=True)
        loss_value = float("nan")
        while self.step < config.steps and (stop_at is None or self.step < stop_at):
            t0 = time.perf_counter()
            lr = lr_at(self.step, config.steps, config.lr, config.warmup_steps, config.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            ids, labels, cu = self.batch(self.step + 1)
            with torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                                enabled=self.autocast is not None):
                loss = self.model(ids, cu_seqlens=cu, labels=labels, return_logits=False).loss
            if not torch.isfinite(loss):
                raise RuntimeError(f"SFT loss became {float(loss)} at step {self.step + 1}; lower --lr")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            loss_value = float(loss.detach())
            first = loss_value if first is None else first
            self.metrics.write({"step": self.step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                                "tokens": int(ids.shape[1]), "step_s": time.perf_counter() - t0})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
            if self.step % config.save_every == 0 or self.step == config.steps:
                self.save()
        bar.close()
        self.model.eval()
        return {"steps": self.step, "first_loss": first, "last_loss": loss_value}
