"""Worker processes for the distributed tests, launched by torchrun (gloo on CPU).

    python -m torch.distributed.run --nproc-per-node N tests/distributed/worker.py SCENARIO --out FILE [...]

Every scenario writes its results as JSON from rank 0; the tests compare them across layouts.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from k3.config import ModelConfig
from k3.layers.balancing import QB_MAX_ITERS
from k3.distributed import (all_gather_cat, clip_grad_norm_, dispatch_stats, get_world_size, init_distributed,
                            is_main, load_checkpoint, parallelize, save_checkpoint, set_balanced, shard_batch,
                            shutdown, skewed_routing, train_steps)
from k3.model import K3ForCausalLM

VOCAB = 256


def build_model(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    # debug preset: 8 experts top-2, so EP = 1, 2 and 4 all divide the experts; float64 for a tight parity.
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).double()
    # Parity at 1e-5 over 20 steps needs routing that last-bit differences between layouts (losses part at 1e-7
    # from step 1) do not flip: the iterated QB balances each routed batch. Under the published rule (one update
    # from the last batch) a flip at step 6 parted the losses by 2e-3 by step 20; its pooling over ranks equals
    # one process exactly (tests/layers/test_qb_published.py).
    for _, router in model.routers():
        router.qb_max_iters = QB_MAX_ITERS
    return model


def global_batches(steps: int, batch: int, length: int, seed: int) -> list[torch.Tensor]:
    """`steps` global batches cycling over two fixed random ones: fresh uniform tokens every step could not
    be learned (the loss would stay near log(vocab)), while repeated ones are memorised, so a run that trains
    visibly lowers its loss."""
    generator = torch.Generator().manual_seed(seed + 1)
    distinct = [torch.randint(0, VOCAB, (batch, length + 1), generator=generator) for _ in range(2)]
    return [distinct[step % 2] for step in range(steps)]


def write(path: str, result: dict) -> None:
    if is_main():
        with open(path, "w") as handle:
            json.dump(result, handle)


def ep_size(args) -> int:
    """--ep, or every rank when not given."""
    return args.ep or get_world_size()


def biases_agree(model) -> bool:
    """Every rank's router biases equal rank 0's (all-gathered and compared)."""
    local = torch.stack([router.e_score_correction_bias for _, router in model.routers()]).reshape(1, -1)
    every = all_gather_cat(local)
    return bool((every == every[0]).all())


def scenario_train(args) -> dict:
    """Train `steps` steps on the shared global batches; optionally save, then optionally load other layouts'
    checkpoints. Reports the losses, the router biases, the gradient norm and the logits after each phase."""
    model = parallelize(build_model(args.seed), ep_size=ep_size(args), balanced=args.balanced)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = train_steps(model, global_batches(args.steps, args.batch, args.length, args.seed), optimizer)
    result = {"losses": losses, "bias": [router.e_score_correction_bias.tolist() for _, router in model.routers()],
              "biases_agree": biases_agree(model), "grad_norms": _clipped_grad_norms(model, args),
              "logits": _eval_logits(model, args)}
    if args.checkpoint:
        save_checkpoint(model, args.checkpoint)
    result["loaded_logits"] = []
    for path in args.load:
        load_checkpoint(model, path)
        result["loaded_logits"].append(_eval_logits(model, args))
    if args.hot:  # the balanced cases too, in this launch (each on a freshly built model): saves a start-up
        result["balanced"] = scenario_balanced(args)
    return result


def _clipped_grad_norms(model, args) -> list[float]:
    """Global gradient norm of the loss on a fixed batch (eval mode: the router biases stay), then the norm
    after clipping to half of it. The gradients are cleared again."""
    ids = global_batches(1, args.batch, args.length, args.seed + 7)[0]
    model.eval()
    local = shard_batch(ids)
    model(local[:, :-1], labels=local[:, 1:]).loss.backward()
    norm = float(clip_grad_norm_(model.parameters(), max_norm=1e9))
    clip_grad_norm_(model.parameters(), max_norm=norm / 2)
    clipped = float(clip_grad_norm_(model.parameters(), max_norm=1e9))
    model.zero_grad(set_to_none=True)
    model.train()
    return [norm, clipped]


def _forward_backward(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss on this rank's shard and every parameter's full gradient (summed over the step)."""
    from k3.distributed.parallelize import full_tensor

    model.zero_grad(set_to_none=True)
    local = shard_batch(ids)
    out = model(local[:, :-1], labels=local[:, 1:])
    out.loss.backward()
    # Layer 0's first AttnRes mix has one source and passes it through: its weights get no gradient.
    grads = {name: full_tensor(p.grad).detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    logits = all_gather_cat(out.logits.detach().reshape(local.shape[0], -1))
    return logits, grads


def scenario_balanced(args) -> dict:
    """Each --hot set in turn (one launch for several): {hot set: _balanced_case}."""
    return {hot: _balanced_case(args, [int(e) for e in hot.split(",")]) for hot in (args.hot or ["0,1"])}


def _balanced_case(args, hot: list[int]) -> dict:
    """Plain vs balanced dispatch on the same skewed batch, on a freshly built model: pair counts, logits and
    gradients."""
    model = parallelize(build_model(args.seed), ep_size=get_world_size(), balanced=False)
    ids = global_batches(1, args.batch, args.length, args.seed)[0]
    results = {}
    with skewed_routing(model, hot):
        for mode in ("plain", "balanced"):
            set_balanced(model, mode == "balanced")
            logits, grads = _forward_backward(model, ids)
            results[mode] = (logits, grads, [s.pairs_per_rank for s in dispatch_stats(model)],
                             [len(s.replicas) for s in dispatch_stats(model)])
    plain, balanced = results["plain"], results["balanced"]
    max_grad_diff = max(float((plain[1][k] - balanced[1][k]).abs().max()) for k in plain[1])
    max_grad = max(float(g.abs().max()) for g in plain[1].values())
    return {
        "pairs_plain": plain[2], "pairs_balanced": balanced[2], "replicas_balanced": balanced[3],
        "max_logit_diff": float((plain[0] - balanced[0]).abs().max()), "max_logit": float(plain[0].abs().max()),
        "max_grad_diff": max_grad_diff, "max_grad": max_grad,
        "grad_names": sorted(plain[1]),
    }


def scenario_load(args) -> dict:
    """Load each --load checkpoint into a model made with other weights on purpose; logits after each."""
    model = parallelize(build_model(args.seed + 100), ep_size=ep_size(args))
    loaded = []
    for path in args.load:
        load_checkpoint(model, path)
        loaded.append(_eval_logits(model, args))
    return {"loaded_logits": loaded}


def _eval_logits(model, args) -> list:
    ids = global_batches(1, args.batch, args.length, args.seed + 7)[0]
    model.eval()
    with torch.no_grad():
        local = shard_batch(ids)
        logits = model(local[:, :-1]).logits
    return all_gather_cat(logits.reshape(local.shape[0], -1)).tolist()


SCENARIOS = {"train": scenario_train, "balanced": scenario_balanced, "load": scenario_load}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ep", type=int, default=0, help="EP group size (default: every rank)")
    parser.add_argument("--balanced", action="store_true")
    parser.add_argument("--checkpoint", default="", help="save here after training")
    parser.add_argument("--load", action="append", default=[],
                        help="checkpoint to load (after training, for `train`); repeatable")
    parser.add_argument("--hot", action="append", default=[],
                        help="experts the skewed router prefers, e.g. 0,1 (balanced, or train then the balanced "
                             "cases; repeatable; default 0,1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    init_distributed(device="cpu")
    write(args.out, SCENARIOS[args.scenario](args))
    shutdown()  # not in a finally: its barrier would hang a rank whose peer raised; torchrun tears those down
    return 0


if __name__ == "__main__":
    sys.exit(main())
