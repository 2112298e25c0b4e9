"""Scale-out: FSDP2 and (balanced) expert parallelism on torch.distributed, applied from outside the model.

    env = init_distributed()                       # torchrun env -> process group (NCCL on GPU, gloo on CPU)
    model = parallelize(model.to(env.device), ep_size=env.world_size, balanced=True)
    # or, for a model too big for one device: built on meta, sharded, each rank initialises only its shards
    model = build_parallel_model(config, env.device, ep_size=env.world_size, seed=0)
    # ep_size: any divisor of the world size and the expert count; world / ep_size EP groups replicate the experts
    ... train; model.update_balancers() now agrees across ranks ...
    save_checkpoint(model, path)                   # loads under any other layout
"""

from k3.distributed.balanced import balanced_plan, imbalance, skewed_routing
from k3.distributed.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from k3.distributed.dispatcher import DispatchStats, ExpertPlan, all_to_all, home_plan
from k3.distributed.init import build_parallel_model, init_weights_seeded
from k3.distributed.launch import (DistEnv, all_gather_cat, all_reduce_sum, barrier, get_rank, get_world_size,
                                   init_distributed, is_distributed, is_main, main_first, shard_batch,
                                   shutdown)
from k3.distributed.loop import clip_grad_norm_, global_mean, train_steps
from k3.distributed.parallelize import (ExpertParallelMoE, check_ep_size, dispatch_stats, global_moe_maxvio,
                                        parallelize, set_balanced)
from k3.distributed.sharded_checkpoint import load_sharded, save_sharded

__all__ = [
    "DispatchStats", "DistEnv", "ExpertParallelMoE", "ExpertPlan", "all_gather_cat", "all_reduce_sum", "all_to_all",
    "balanced_plan", "barrier", "build_parallel_model", "check_ep_size", "clip_grad_norm_", "dispatch_stats", "full_state_dict", "get_rank",
    "get_world_size", "global_mean", "global_moe_maxvio", "home_plan", "imbalance", "init_distributed",
    "init_weights_seeded", "is_distributed", "is_main", "load_checkpoint", "load_sharded", "main_first",
    "parallelize", "save_checkpoint", "save_sharded", "set_balanced", "shard_batch", "shutdown", "skewed_routing",
    "train_steps",
]
