"""A `k3 train`-style run directory with random weights, for benchmarks that need a run but not a trained model
(`k3 eval`'s lengths, `k3 serve`): checkpoint.pt (weights saved in bf16 to halve the write) and tokenizer/ (a
byte-level BPE trained on the eval filler text). Seconds, where training even a few steps takes minutes.

Usage: python bench/random_run.py --preset small --out DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from k3.checkpoint.native import save_checkpoint
from k3.config import ModelConfig
from k3.data.tokenizer import train_bpe
from k3.eval.tasks import DEFAULT_FILLER_TEXT
from k3.model import K3ForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe([DEFAULT_FILLER_TEXT + " 0123456789 " + " ".join(map(str, range(1000)))] * 4,
                          vocab_size=1024, show_progress=False)
    # The preset's own vocabulary (the tokenizer uses its first ids), or the tokenizer's where that is larger.
    vocab = max(ModelConfig.from_preset(args.preset).vocab_size, tokenizer.vocab_size)
    config = ModelConfig.from_preset(args.preset, vocab_size=vocab)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = K3ForCausalLM(config)
    state = {name: tensor.detach().to("cpu", torch.bfloat16 if tensor.is_floating_point() else tensor.dtype)
             for name, tensor in model.state_dict().items()}
    save_checkpoint(out / "checkpoint.pt", {"config": config.to_dict(), "model": state, "step": 0})
    tokenizer.save(out / "tokenizer")
    print(f"random {args.preset} run written to {out} in {time.perf_counter() - start:.1f} s "
          f"({sum(t.numel() for t in state.values()) / 1e6:.0f}M parameters)", flush=True)


if __name__ == "__main__":
    main()
