"""What balancing buys: the same `k3 train` run under published Quantile Balancing, the iterated QB, DeepSeek's
loss-free sign update and no balancing, on the same tokens and seeds, and what each costs in the step.

    python bench/qb_ablation.py --prepare --work W            # tokenizer + corpus for every arm, kernels warmed
    python bench/qb_ablation.py --arm published --work W --out O [--steps 2000 --seq 512 --batch 4 --layers 8]
    python bench/qb_ablation.py --cost --out O [--seq 512 --batch 4 --layers 8]
    python bench/qb_ablation.py --report O                    # the table from the arms' JSON files

Arms (k3.train.Trainer, the graphed CUDA step, bf16 autocast, the `small` preset, --layers of them):
  published  moe_balancing=quantile, qb_iters=0: one QB update per MoE layer and step, applied at the next step
  iterated   moe_balancing=quantile, qb_iters=4: the update iterated on the routed batch (4 updates on the device,
             the most balanced iterate kept)
  loss_free  moe_balancing=loss_free (b_e += 1e-3 sign(mean load - load_e) after each step)
  none       moe_balancing=none
Each arm writes O/<arm>.json: the loss and maxvio (max over MoE layers of the routed batch) of every step, the
validation loss every --eval-every steps, and dead (no pair) / starved (< 10% of the mean load) experts over 8
batches after training. --cost times, solo on the GPU, the graphed forward + backward and the optimizer step of
each rule, and all routers' forwards (logits, sigmoid, selection, QB) replayed as one CUDA graph: O/cost.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from k3.ops.triton_support import limit_triton_autotune_from_env

limit_triton_autotune_from_env()  # before anything imports fla (K3_AUTOTUNE_CONFIGS, as the kernel cache was built)

from k3.atomic import atomic_write_bytes  # noqa: E402
from k3.train.metrics import read_metrics  # noqa: E402
from k3.train.trainer import TrainConfig, Trainer  # noqa: E402

ARMS = {
    "published": ({"moe_balancing": "quantile"}, 0),
    "iterated": ({"moe_balancing": "quantile"}, 4),
    "loss_free": ({"moe_balancing": "loss_free"}, 0),
    "none": ({"moe_balancing": "none"}, 0),
}


def model_overrides(layers: int) -> dict:
    if layers == 16:
        return {}
    return {"num_layers": layers, "full_attn_layers": list(range(4, layers + 1, 4))}


def config_for(args, out: Path, arm: str) -> TrainConfig:
    overrides, qb_iters = ARMS[arm]
    return TrainConfig.flat(preset="small", out=str(out), max_steps=args.steps + 1, seq_len=args.seq,
                            batch_size=args.batch, device=args.device, cuda_graph=args.device == "cuda",
                            eval_every=args.eval_every, eval_batches=4, save_every=10 ** 9,
                            max_corpus_mb=args.corpus_mb, tokenizer_sample_mb=4.0, qb_iters=qb_iters, seed=0,
                            model_overrides={**model_overrides(args.layers), **overrides})


def write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(payload) + "\n").encode())


def prepare(args) -> None:
    out = Path(args.work) / "prep"
    shutil.rmtree(out, ignore_errors=True)
    # Writes tokenizer/ and data/; a few steps compile and tune the kernels at this shape before any arm runs.
    Trainer(config_for(args, out, "published"), show_progress=False).train(stop_at=3)


@torch.no_grad()
def expert_loads(trainer: Trainer, batches: int = 8) -> list[list[float]]:
    """Pairs per expert of every MoE layer over `batches` fresh training batches, routed as in training
    (train mode, the bias as it stands; every buffer put back afterwards, no balancer update)."""
    model = trainer.model
    saved = [(b, b.clone()) for b in model.buffers()]
    totals = None
    for _ in range(batches):
        rows = trainer._rows(trainer._next_batch()[0])
        with trainer._autocast():
            model(rows["ids"])
        loads = [router.last_load_E.float().cpu() for _, router in model.routers()]
        totals = loads if totals is None else [a + b for a, b in zip(totals, loads)]
        for buffer, value in saved:
            buffer.copy_(value)
    return [t.tolist() for t in totals]


def run_arm(args) -> None:
    arm = args.arm
    work = Path(args.work) / arm
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for part in ("tokenizer", "data"):
        shutil.copytree(Path(args.work) / "prep" / part, work / part)
    started = time.perf_counter()
    trainer = Trainer(config_for(args, work, arm), show_progress=False, log=lambda *_: None)
    # In chunks, so that a wall-clock budget (--budget-s, counted from here) ends the arm with its metrics kept.
    deadline = time.perf_counter() + args.budget_s
    summary = {}
    while trainer.step < args.steps and time.perf_counter() < deadline:
        summary = trainer.train(stop_at=min(trainer.step + 250, args.steps))
    rows = read_metrics(work / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    loads = expert_loads(trainer)
    mean_load = [sum(layer) / len(layer) for layer in loads]
    write(Path(args.out) / f"{arm}.json", {
        "arm": arm, "steps": len(steps), "seq_len": args.seq, "batch": args.batch, "layers": args.layers,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "wall_s": time.perf_counter() - started,
        "loss": [r["loss"] for r in steps], "maxvio": [r["maxvio"] for r in steps],
        "maxvio_layer_mean": [float(np.mean(list(r["maxvio_per_layer"].values()))) for r in steps],
        "step_seconds": [r["step_seconds"] for r in steps],
        "val_loss": {str(r["step"]): r["val_loss"] for r in rows if "val_loss" in r},
        "dead_experts": sum(sum(1 for v in layer if v == 0) for layer in loads),
        "starved_experts": sum(sum(1 for v in layer if v < 0.1 * m) for layer, m in zip(loads, mean_load)),
        "expert_loads": loads, "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str))}})


def cost(args) -> None:
    """Solo timings of each rule: graphed forward + backward, the optimizer step, and every router's forward."""
    from k3 import K3ForCausalLM, ModelConfig
    from k3.layers.moe import Router
    from k3.train.graphed_step import GraphedTrainStep
    from k3.train.optim import build_optimizer

    config = ModelConfig.from_preset("small", **model_overrides(args.layers))
    torch.manual_seed(0)
    model = K3ForCausalLM(config).cuda().train()
    routers = [m for m in model.modules() if isinstance(m, Router)]
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")

    def loss_fn(m, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(batch["ids"], labels=batch["ids"], return_logits=False).loss

    inputs = []
    hooks = [r.register_forward_pre_hook(lambda mod, a: inputs.append((mod, a[0].detach().clone())))
             for r in routers]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(ids)
    for h in hooks:
        h.remove()
    optimizer = build_optimizer(model, 1e-4, 0.1)
    saved = [(b, b.clone()) for b in model.buffers()]

    def events_ms(fn, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return float(np.median(times))

    results = {}
    for arm, (overrides, qb_iters) in ARMS.items():
        for r in routers:
            r.balancing, r.qb_max_iters, r.qb_device_updates = overrides["moe_balancing"], qb_iters, None
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for r in routers:  # the router graph, each rule's forward as the training step runs it
                if qb_iters:
                    r.qb_device_updates = qb_iters
            for _ in range(2):
                for r, x in inputs:
                    r(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for r, x in inputs:
                    r(x)
            router_ms = events_ms(graph.replay, 50)
            del graph
        for r in routers:
            r.qb_device_updates = None
        step = GraphedTrainStep(model, loss_fn, {"ids": ids}, qb_updates=qb_iters or None)
        step({"ids": ids})
        fwd_bwd_ms = events_ms(functools.partial(step, {"ids": ids}), 30)  # no closure over `step`, deleted below

        def opt():
            optimizer.step()
            model.update_balancers()
        opt_ms = events_ms(opt, 10)
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
        del step
        torch.cuda.empty_cache()
        results[arm] = {"routers_ms": router_ms, "fwd_bwd_ms": fwd_bwd_ms, "optimizer_ms": opt_ms,
                        "router_share": router_ms / (fwd_bwd_ms + opt_ms)}
        print(arm, results[arm], flush=True)
    none = results["none"]["routers_ms"]
    for arm in results:
        results[arm]["qb_ms"] = results[arm]["routers_ms"] - none
    write(Path(args.out) / "cost.json", {"device": torch.cuda.get_device_name(), "seq_len": args.seq,
                                         "batch": args.batch, "layers": args.layers, "moe_layers": len(routers),
                                         "results": results})


def report(out: str) -> None:
    rows = []
    cost_path = Path(out) / "cost.json"
    costs = json.loads(cost_path.read_text())["results"] if cost_path.is_file() else {}
    runs = {arm: json.loads((Path(out) / f"{arm}.json").read_text()) for arm in ARMS
            if (Path(out) / f"{arm}.json").is_file()}
    common = min((a["steps"] for a in runs.values()), default=0)  # equal tokens: the steps every arm ran
    print(f"{common} steps in every arm")
    for arm, a in runs.items():
        m = np.array(a["maxvio"][:common])
        settled = m[len(m) // 10:]
        loss = np.array(a["loss"][:common])
        val = a["val_loss"]
        last_val = val[max(val, key=int)] if val else float("nan")
        c = costs.get(arm, {})
        rows.append([arm, a["steps"], f"{loss[-100:].mean():.4f}", f"{last_val:.4f}", f"{m.mean():.3f}",
                     f"{np.quantile(m, 0.95):.3f}", f"{settled.mean():.3f}", f"{np.quantile(settled, 0.95):.3f}",
                     a["dead_experts"], a["starved_experts"],
                     f"{c.get('routers_ms', float('nan')):.2f}", f"{100 * c.get('router_share', float('nan')):.2f}%"])
    headers = ["arm", "steps run", "train loss (last 100 common)", "val loss (last)", "maxvio mean", "maxvio p95",
               "mean (after 10%)", "p95 (after 10%)", "dead", "starved", "routers ms/step", "router share"]
    print("| " + " | ".join(headers) + " |")
    print("|" + " --- |" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true")
    parser.add_argument("--arm", choices=list(ARMS))
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--report", metavar="DIR")
    parser.add_argument("--work", default="runs/qb_ablation")
    parser.add_argument("--out", default="bench/results/qb_ablation")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="an arm's training wall-clock cap")
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument("--device", default="cuda", help="cuda (the graphed step) or cpu (a smoke run)")
    args = parser.parse_args()
    if args.prepare:
        prepare(args)
    elif args.arm:
        run_arm(args)
    elif args.cost:
        cost(args)
    elif args.report:
        report(args.report)
    else:
        sys.exit("give --prepare, --arm NAME, --cost or --report DIR")


if __name__ == "__main__":
    main()
