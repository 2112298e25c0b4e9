"""The LM head + cross-entropy (k3.ops.linear_ce): each path against the plain one, in one run.

Usage: python bench/linear_ce.py [--tokens 16384] [--hidden 1024] [--vocab 32768] [--paths plain fused chunked fla]
                                 [--chunk-rows 4096] [--device cuda] [--out linear_ce.json]

Each path runs forward + backward of the mean loss over `tokens` rows ([tokens, hidden] activations, a
[vocab, hidden] head, bf16 on CUDA, fp32 on CPU). Reported per path: ms per forward+backward, peak memory above
the inputs (CUDA: max_memory_allocated; CPU: the peak resident set of a fresh process per path), and the
loss's and gradients' difference from the plain path's. The defaults are `small`'s head at B=4 x T=4096.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

from common import print_table, time_ms, write_json

from k3.ops import linear_ce
from k3.ops.linear_ce import linear_cross_entropy


def run_path(path: str, tokens: int, hidden: int, vocab: int, device: str, repeats: int, chunk_rows: int) -> dict:
    os.environ["K3_LINEAR_CE"] = path
    linear_ce.CHUNK_ROWS = chunk_rows
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, device=device, generator=gen) * hidden ** -0.5)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)

    def step():
        h.grad = head.weight.grad = None
        loss = linear_cross_entropy(h, head, labels)
        loss.backward()
        return loss

    loss = step().item()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ms = time_ms(step, warmup=1, repeats=repeats)
    peak = (torch.cuda.max_memory_allocated() - base if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return dict(ms=ms, peak_bytes=peak, loss=loss, grad_h=h.grad.float().cpu(), grad_w=head.weight.grad.float().cpu())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--paths", nargs="+", default=["plain", "fused", "chunked", "fla"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-rows", type=int, default=linear_ce.CHUNK_ROWS, help="rows per chunk (chunked)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # CPU: one path per fresh process
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = (args.tokens, args.hidden, args.vocab, args.device, args.repeats, args.chunk_rows)
    if args.child:
        result = run_path(args.child, *shape)
        torch.save(result, sys.stdout.buffer)
        return
    results = {}
    for path in args.paths:
        if path in ("fla", "fused") and args.device != "cuda":
            continue
        if args.device == "cuda":
            results[path] = run_path(path, *shape)
            torch.cuda.empty_cache()
        else:  # a fresh process, so that each path's peak resident set is its own
            done = subprocess.run([sys.executable, __file__, "--child", path, "--tokens", str(args.tokens),
                                   "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--device", "cpu",
                                   "--repeats", str(args.repeats), "--chunk-rows", str(args.chunk_rows)],
                                  capture_output=True, check=True)
            import io
            results[path] = torch.load(io.BytesIO(done.stdout))
    plain = results.get("plain")
    rows, summary = [], {}
    for path, r in results.items():
        diff = {}
        if plain is not None:
            diff = {key: ((r[key] - plain[key]).norm() / plain[key].norm()).item() for key in ("grad_h", "grad_w")}
            diff["loss"] = abs(r["loss"] - plain["loss"])
        summary[path] = dict(ms=r["ms"], peak_gib=r["peak_bytes"] / 2**30, loss=r["loss"], vs_plain=diff)
        rows.append([path, r["ms"], f"{plain['ms'] / r['ms']:.2f}x" if plain else "", r["peak_bytes"] / 2**30,
                     diff.get("loss", ""), diff.get("grad_h", ""), diff.get("grad_w", "")])
    print_table(f"LM head + cross-entropy, forward + backward, {args.tokens} x {args.hidden} -> {args.vocab}, "
                f"{args.device}", ["path", "ms", "speed-up vs plain", "peak GiB", "|d loss|", "grad h rel diff",
                                   "grad W rel diff"], rows)
    write_json(args.out, {"bench": "linear_ce", "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                          "device": args.device, "results": summary})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
