"""Check every CUDA fast path against its PyTorch twin, on fresh random inputs, in one run.

Usage: python bench/gpu_check.py [--checks NAME ...] [--out results.json] [--device cuda]

Checks (relative error ||fast - twin|| / ||twin||, every output and gradient):
  kda_chunk      fla chunk_kda (in-kernel safe gate, beta sigmoid, L2 norm; packed cu_seqlens) vs PyTorch chunk
  kda_recurrent  fla fused_recurrent_kda (in-kernel gate) vs PyTorch recurrence, with a carried state
  moe_grouped    torch._grouped_mm experts vs the per-expert loop (bf16; some experts get no tokens)
  attn_res       the AttnRes mix's Triton kernels vs eager (and the forcible torch.compile-fused mix vs eager)
  rms_norm       k3's RMSNorm Triton kernels (the CUDA default) vs the twin, at D 1024 and 9000 (chunked rows)
  glu            the GLU activation's Triton kernels (training on CUDA) vs the eager formula, SiTU and SiLU
  router_logits  the router's logits as bf16 GEMMs with fp32 output vs the fp32 form (logits and both grads)
  moe_combine    the MoE combine's Triton kernels vs the batched matmul (output, pair-output and gate-weight grads)
  short_conv     KDA's short conv through k3's Triton kernels (joined and planar q/k/v, dense and packed) vs the twin
  adamw          SplitAdamW (Triton kernel for tensors >= TRITON_MIN_NUMEL) vs torch.optim.AdamW(fused=True),
                 bf16 and fp32, per step from equal states: error / (1 ulp + 1e-6 x the step's terms), tol 1
  master_adamw   the fused master-weight AdamW pass (bf16 parameters, fp32 masters) vs its PyTorch twin over
                 three steps with the clip applied: parameters, masters and moments equal bit for bit (tol 0)
  mla_flash      MLA prefill with SDPA forced to the flash kernel vs the math kernel
  model          whole model (debug preset x4 widths, bf16) under the fast run's expert choices: all fast
                 paths, then each fast path alone, against an fp32 run of the twins, next to the bf16 twin's
                 own error (free-routing errors and the expert flip rate as info rows)
  static_decode  static-cache decode, eager and CUDA-graph replay, vs the full forward's logits
Prints a table; exits 1 if any check fails or errors. Also runs on CPU (fast paths then equal their twins).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import traceback

import torch

from common import print_table, relative_error, write_json

from k3 import K3ForCausalLM, ModelConfig
from k3.ops.glu import glu_activation
from k3 import kernels
from k3.ops.attn_res import attn_res_mix
from k3.ops.kda import chunk_kda, fused_recurrent_kda, kda_backend, training_options
from k3.ops.moe import count_per_expert, run_experts
from k3.ops.moe_combine import weighted_sum_over_k
from k3.ops.norm import rms_norm
from k3.ops.router_logits import router_logits
from k3.rl.routing import RoutingReplay

BF16_TOL = 2e-2  # bf16 operands (METHOD: 1e-3..1e-2), with margin for long recurrences
FP32_TOL = 2e-3  # fp32 in, tf32/bf16 inside fla's kernels


# The model's fast paths, each a group of k3.kernels switches (check_model runs each group fast alone).
PATHS = {"kda": ("kda",), "fused": ("fused",), "attn_res": ("attn_res",),
         "moe": ("moe", "moe_combine", "router_logits")}


def twins(on: bool | tuple[str, ...]) -> contextlib.AbstractContextManager[None]:
    """Inside: every switch at its PyTorch twin (on=True, kernels.reference()), or the named paths' switches
    (a tuple of PATHS keys; none for on=False)."""
    if on is True:
        return kernels.reference()
    return kernels.use(**{switch: "torch" for path in (on or ()) for switch in PATHS[path]})


def grads_of(outputs: list[torch.Tensor], inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Gradients of a fixed random projection of outputs w.r.t. inputs."""
    gen = torch.Generator(device=outputs[0].device).manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o in outputs)
    return list(torch.autograd.grad(loss, inputs, allow_unused=True))


def graph_has(output: torch.Tensor, node_name: str) -> bool:
    """Whether the autograd graph that made `output` contains a node whose name contains `node_name`."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node_name in node.name():
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def path_row(name: str, fast_ran: bool, fast: str, other: str, device, rows: list) -> None:
    """The row naming the path the fast side took: FAIL on CUDA unless it is the fast one."""
    rows.append([name, "path (fast)", fast if fast_ran else other, "-",
                 "ok" if fast_ran or device.type != "cuda" else "FAIL"])


def compare(name: str, fast: list[torch.Tensor], twin: list[torch.Tensor], labels: list[str], tol: float,
            rows: list) -> None:
    for label, a, b in zip(labels, fast, twin):
        if a is None or b is None:
            rows.append([name, label, "missing", tol, "FAIL"])
            continue
        err = relative_error(a, b)
        rows.append([name, label, err, tol, "ok" if err <= tol else "FAIL"])


def kda_chunk_case(device):
    """Packed documents at `small`'s KDA head shape: run(**options) -> [o, final state, every gradient]."""
    torch.manual_seed(1)
    lens = [63, 500, 1000, 1537]
    total, H, K = sum(lens), 8, 128  # the `small` preset's head shape: fla tunes its kernels once for all runs
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    q, k, v = (torch.randn(1, total, H, K, device=device, dtype=torch.bfloat16) for _ in range(3))
    raw_g = torch.randn(1, total, H, K, device=device, dtype=torch.bfloat16)
    beta_logits = torch.randn(1, total, H, device=device, dtype=torch.bfloat16)
    A_log = torch.rand(H, device=device).mul(2).requires_grad_()
    dt_bias = torch.randn(H * K, device=device).mul(0.5).requires_grad_()
    h0 = torch.randn(len(lens), H, K, K, device=device)
    leaves = [t.requires_grad_() for t in (q, k, v, raw_g, beta_logits)] + [A_log, dt_bias, h0.requires_grad_()]

    def run(**options):
        o, ht = chunk_kda(q, k, v, raw_g, beta_logits, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu, use_gate_in_kernel=True, A_log=A_log,
                          dt_bias=dt_bias, lower_bound=-5.0, safe_gate=True, use_beta_sigmoid_in_kernel=True,
                          **options)
        return [o, ht] + grads_of([o, ht], leaves, seed=2)

    return run, q


KDA_LABELS = ["o", "final_state", "dq", "dk", "dv", "dg_raw", "dbeta", "dA_log", "ddt_bias", "dh0"]


def check_kda_chunk(device, rows) -> None:
    run, q = kda_chunk_case(device)
    fast = run()
    with twins(True):
        twin = run()
    compare(f"kda_chunk[{kda_backend(q)}]", fast, twin, KDA_LABELS, BF16_TOL, rows)


def check_kda_options(device, rows) -> None:
    """fla's training options (k3.ops.kda.training_options): the forward's intermediates kept for the backward
    must give what recomputing them gives (the same kernels: 1e-3), chunks of 32 what the twin gives."""
    run, q = kda_chunk_case(device)
    recomputed = run()
    for switches, reference, tol in ((dict(kda_keep="1"), recomputed, 1e-3), (dict(kda_chunk="32"), None, BF16_TOL)):
        with kernels.use(**switches):
            options = training_options()
        if reference is None:
            with twins(True):
                reference = run()
        name = ",".join(f"{key}={value}" for key, value in switches.items())
        compare(f"kda_options[{name}][{kda_backend(q)}]", run(**options), reference, KDA_LABELS, tol, rows)


def check_kda_recurrent(device, rows) -> None:
    torch.manual_seed(3)
    B, T, H, K = 3, 5, 8, 128
    q, k, v = (torch.randn(B, T, H, K, device=device, dtype=torch.bfloat16) for _ in range(3))
    raw_g = torch.randn(B, T, H, K, device=device, dtype=torch.bfloat16)
    beta_logits = torch.randn(B, T, H, device=device, dtype=torch.bfloat16)
    A_log, dt_bias = torch.rand(H, device=device), torch.randn(H * K, device=device) * 0.5
    h0 = torch.randn(B, H, K, K, device=device)

    def run():
        with torch.no_grad():
            return list(fused_recurrent_kda(q, k, v, raw_g, beta_logits, initial_state=h0.clone(),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                            lower_bound=-5.0, use_beta_sigmoid_in_kernel=True))

    fast = run()
    with twins(True):
        twin = run()
    compare(f"kda_recurrent[{kda_backend(q)}]", fast, twin, ["o", "final_state"], BF16_TOL, rows)


def check_moe(device, rows) -> None:
    torch.manual_seed(4)
    E, F_, D, N = 16, 256, 128, 3000
    ids = torch.randint(0, E - 3, (N,), device=device)  # the last three experts get no tokens
    ids = ids.sort().values
    counts = count_per_expert(ids, E)
    x = torch.randn(N, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(E, F_, D, device=device) * D**-0.5).to(torch.bfloat16).requires_grad_() for _ in range(2)]
    w2 = (torch.randn(E, D, F_, device=device) * F_**-0.5).to(torch.bfloat16).requires_grad_()

    def run():
        y = run_experts(x, counts, ws[0], ws[1], w2, "situ", (4.0, 25.0))
        return [y] + grads_of([y], [x, *ws, w2], seed=5)

    fast = run()
    with twins(True):
        twin = run()
    # A zero error can also mean both runs took the same path: say which kernels each one recorded.
    kernels = (graph_has(fast[0], "GroupedMm"), graph_has(twin[0], "GroupedMm"))
    rows.append(["moe_grouped", "path (fast, twin)", f"{'grouped' if kernels[0] else 'loop'}, "
                 f"{'grouped' if kernels[1] else 'loop'}", "-", "ok" if kernels == (True, False) else "FAIL"])
    compare("moe_grouped", fast, twin, ["y", "dx", "dw1", "dw3", "dw2"], BF16_TOL, rows)
    bincount = torch.bincount(ids, minlength=E)
    rows.append(["moe_counts", "count_per_expert", float((counts != bincount).sum()), 0.0,
                 "ok" if torch.equal(counts, bincount) else "FAIL"])


def check_attn_res(device, rows) -> None:
    torch.manual_seed(6)
    sources = [torch.randn(2, 512, 1024, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(5)]
    norm_w = torch.rand(1024, device=device, requires_grad=True)
    query = torch.randn(1024, device=device, requires_grad=True)

    def run():
        y = attn_res_mix(sources, norm_w, query, 1e-5)
        return [y] + grads_of([y], [*sources, norm_w, query], seed=7)

    fast = run()
    with twins(True):
        twin = run()
    labels = ["mix"] + [f"d_source{i}" for i in range(5)] + ["d_norm_w", "d_query"]
    # The kernels' autograd node (k3.ops.attn_res_triton).
    path_row("attn_res", graph_has(fast[0], "AttnResMix"), "triton", "other", device, rows)
    compare("attn_res", fast, twin, labels, BF16_TOL, rows)
    with kernels.use(attn_res="compiled"):
        compiled = run()
    compare("attn_res_compiled", compiled, twin, labels, BF16_TOL, rows)


def check_rms_norm(device, rows) -> None:
    """k3's RMSNorm kernels (the CUDA default) against the twin (K3_FUSED_BACKEND=torch), at the `small` width
    and at one wider than a whole-row tile."""
    for width in (1024, 9000):
        torch.manual_seed(14)
        x = torch.randn(4, 700, width, device=device, dtype=torch.bfloat16, requires_grad=True)
        weight = (1 + 0.1 * torch.randn(width, device=device)).to(torch.bfloat16).requires_grad_()

        def run():
            y = rms_norm(x, weight, 1e-6)
            return [y] + grads_of([y], [x, weight], seed=15)

        fast = run()
        with twins(("fused",)):
            twin = run()
        path_row(f"rms_norm_{width}", graph_has(fast[0], "_RMSNorm"), "triton", "other", device, rows)
        compare(f"rms_norm_{width}", fast, twin, ["y", "dx", "dweight"], BF16_TOL, rows)


def check_glu(device, rows) -> None:
    """The GLU activation's Triton kernels (training on CUDA) against the eager formula (K3_FUSED_BACKEND=torch
    keeps it), SiTU and SiLU, gate and up as the strided halves of one fused output."""
    for kind in ("situ", "silu"):
        torch.manual_seed(16)
        both = (torch.randn(3000, 2048, device=device) * 4).to(torch.bfloat16).requires_grad_()
        gate, up = both.chunk(2, dim=-1)

        def run():
            h = glu_activation(gate, up, kind)
            return [h] + grads_of([h], [both], seed=17)

        fast = run()
        with twins(("fused",)):
            twin = run()
        path_row(f"glu_{kind}", graph_has(fast[0], "_GLU"), "triton", "other", device, rows)
        compare(f"glu_{kind}", fast, twin, ["h", "d(gate|up)"], BF16_TOL, rows)


def check_router_logits(device, rows) -> None:
    """The router's logits as bf16 GEMMs with fp32 output against the fp32 form, at `small`'s router shape."""
    torch.manual_seed(18)
    x = torch.randn(4096, 1024, device=device).to(torch.bfloat16).requires_grad_()
    w = (0.02 * torch.randn(64, 1024, device=device)).to(torch.bfloat16).requires_grad_()

    def run():
        logits = router_logits(x, w)
        return [logits] + grads_of([logits], [x, w], seed=19)

    fast = run()
    with twins(("moe",)):
        twin = run()
    path_row("router_logits", graph_has(fast[0], "RouterLogitsBF16"), "bf16 gemms", "fp32", device, rows)
    compare("router_logits", fast, twin, ["logits", "dx", "dw"], BF16_TOL, rows)
    # The forward differs from the fp32 form only in the order of its fp32 sums.
    compare("router_logits", fast[:1], twin[:1], ["logits (fp32 tol)"], 1e-5, rows)


def check_moe_combine(device, rows) -> None:
    torch.manual_seed(12)
    y = torch.randn(3000, 6, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(3000, 6, device=device, requires_grad=True)

    def run():
        out = weighted_sum_over_k(y, w)
        return [out] + grads_of([out], [y, w], seed=13)

    fast = run()
    with twins(("moe",)):
        twin = run()
    path_row("moe_combine", graph_has(fast[0], "CombinePairs"), "triton", "bmm", device, rows)
    # The kernels keep the gate weights in fp32 where the bmm rounds them to bf16: dw differs by that rounding.
    compare("moe_combine", fast, twin, ["out", "dy", "dw"], BF16_TOL, rows)


def check_short_conv(device, rows) -> None:
    """KDA's short conv (W = 4, SiLU) through k3's Triton kernels (the training path on CUDA) against the twin
    (K3_FUSED_BACKEND=torch), at `small`'s joined q/k/v width: the joined output and the planar parts KDA takes,
    over a batch of rows and over packed documents (cu_seqlens, B = 1). x is a column slice of a wider tensor, as
    it comes from the fused projection."""
    from k3.ops.short_conv import short_conv, short_conv_parts

    for packed in (False, True):
        torch.manual_seed(22)
        batch, length = (1, 2100) if packed else (2, 1000)
        wide = torch.randn(batch, length, 3072 + 256, device=device).to(torch.bfloat16).requires_grad_()
        x = wide[..., :3072]
        weight = (0.5 * torch.randn(3072, 4, device=device)).to(torch.bfloat16).requires_grad_()
        cu = torch.tensor([0, 63, 700, 1501, 2100], device=device) if packed else None

        def run():
            y, _ = short_conv(x, weight, cu_seqlens=cu)
            parts, _ = short_conv_parts(x, weight, 3, cu_seqlens=cu)
            return [y, *parts] + grads_of([y, *parts], [wide, weight], seed=23)

        fast = run()
        with twins(("fused",)):
            twin = run()
        name = f"short_conv{'_packed' if packed else ''}"
        path_row(name, graph_has(fast[0], "_ShortConv"), "triton", "other", device, rows)
        compare(name, fast, twin, ["y", "q", "k", "v", "dx", "dweight"], BF16_TOL, rows)


def check_adamw(device, rows) -> None:
    """SplitAdamW against torch.optim.AdamW(fused=True) over the same tensors: two above TRITON_MIN_NUMEL (the
    kernel's, one with a ragged last block) and two below (torch's fused kernel inside SplitAdamW too), in bf16 and
    fp32, a decayed group and an undecayed one, three steps with lr changing between them. After each step the
    twin takes SplitAdamW's values, so that each step is compared from equal states.

    The tolerance of an element: one ulp of its dtype at the larger of the two values, plus 1e-6 (8 fp32 ulps) of
    the step's terms (the largest of the value before, after, and its change; for a parameter at least lr). Why:
    torch's fused kernel blends the moments and applies the weight decay in fp64, the kernel in fp32, so their
    fp32 results differ by a few fp32 roundings of the terms; each is then rounded once to the storage dtype, and
    two values that close round to the same value or to neighbours (one ulp) unless the terms cancel, where the
    fp32 part of the bound takes over. The row's value is the worst error over that tolerance."""
    from k3.train.optim import TRITON_MIN_NUMEL, SplitAdamW

    shapes = {"kernel": [(TRITON_MIN_NUMEL // 1024 + 3, 1024), (TRITON_MIN_NUMEL // 999 + 1, 999)],
              "torch": [(TRITON_MIN_NUMEL // 1024 - 1, 1024), (777,)]}
    lrs, betas = (1e-3, 5e-4, 2e-4), (0.9, 0.95)
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device=device).manual_seed(21)
        sizes = [shape for route in ("kernel", "torch") for shape in shapes[route]]
        values = [torch.randn(shape, device=device, generator=gen).mul_(0.02).to(dtype) for shape in sizes]
        params = [torch.nn.Parameter(v.clone()) for v in values]
        twin_params = [torch.nn.Parameter(v.clone()) for v in values]

        def groups(ps):  # the large pair and the small pair each split over a decayed and an undecayed group
            return [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1], ps[3]], "weight_decay": 0.0}]

        split = SplitAdamW(groups(params), lr=lrs[0], betas=betas, fused=True)
        twin = torch.optim.AdamW(groups(twin_params), lr=lrs[0], betas=betas, fused=True)
        worst: dict[tuple[str, str], float] = {}
        for lr in lrs:
            for p, q in zip(params, twin_params):
                p.grad = torch.randn(p.shape, device=device, generator=gen).mul_(1e-3).to(dtype)
                q.grad = p.grad.clone()
            before = [(p.detach().clone(), *(split.state[p][k].clone() if p in split.state else torch.zeros_like(p)
                                             for k in ("exp_avg", "exp_avg_sq"))) for p in params]
            for opt in (split, twin):
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            for i, (p, q) in enumerate(zip(params, twin_params)):
                route = "kernel" if i < 2 else "torch"
                got = (p.detach(), split.state[p]["exp_avg"], split.state[p]["exp_avg_sq"])
                want = (q.detach(), twin.state[q]["exp_avg"], twin.state[q]["exp_avg_sq"])
                for name, a, b, was in zip(("param", "exp_avg", "exp_avg_sq"), got, want, before[i]):
                    a64, b64, was64 = a.double(), b.double(), was.double()
                    terms = torch.maximum(torch.maximum(b64.abs(), was64.abs()), (b64 - was64).abs())
                    if name == "param":
                        terms = terms.clamp_min(lr)
                    finfo = torch.finfo(dtype)
                    _, exponent = torch.frexp(torch.maximum(a64.abs(), b64.abs()).clamp_min(finfo.tiny))
                    ulp = finfo.eps * torch.pow(2.0, exponent.double() - 1)
                    ratio = float(((a64 - b64).abs() / (ulp + 1e-6 * terms)).max())
                    worst[(route, name)] = max(worst.get((route, name), 0.0), ratio)
            with torch.no_grad():  # the twin goes on from SplitAdamW's state: every step starts equal
                for p, q in zip(params, twin_params):
                    q.copy_(p)
                    for key in ("exp_avg", "exp_avg_sq"):
                        twin.state[q][key].copy_(split.state[p][key])
        label = str(dtype).removeprefix("torch.")
        path_row(f"adamw_{label}", split.triton_stepped == 2, "triton (2 tensors)",
                 f"{split.triton_stepped} tensors through the kernel", device, rows)
        for (route, name), ratio in worst.items():
            rows.append([f"adamw_{label}", f"{name} ({route})", ratio, 1.0, "ok" if ratio <= 1.0 else "FAIL"])


def check_master_adamw(device, rows) -> None:
    from k3.ops import master_adamw

    if not master_adamw.fused_available(device):
        rows.append(["master_adamw", "path", "no kernel here (needs CUDA or TRITON_INTERPRET=1)", "-", "info"])
        return
    shapes = [(1024, 1024), (4096, 257), (3,)]  # whole blocks, a tail, a tensor smaller than a block

    def tensors():
        gen = torch.Generator(device=device).manual_seed(11)
        masters = [torch.randn(s, device=device, generator=gen) * 0.02 for s in shapes]
        grads = [(torch.randn(s, device=device, generator=gen) * 1e-3).to(torch.bfloat16) for s in shapes]
        return ([m.to(torch.bfloat16) for m in masters], grads, masters, [torch.zeros_like(m) for m in masters],
                [torch.zeros_like(m) for m in masters], [torch.zeros((), device=device) for _ in shapes])

    kernel, twin = tensors(), tensors()
    scale = torch.tensor(0.8, device=device)
    taken = 0
    for lr in (3e-4, 2e-4, 1e-4):
        for lists in (kernel, twin):
            torch._foreach_add_(lists[5], 1)
        taken = master_adamw.master_adamw_step(*kernel, lr, 0.9, 0.95, 1e-8, 0.1, grad_scale=scale)
        master_adamw.master_adamw_step_torch(*twin, lr, 0.9, 0.95, 1e-8, 0.1, grad_scale=scale)
    path_row("master_adamw", taken == len(shapes), f"triton ({len(shapes)} tensors)", f"{taken} through the kernel",
             device, rows)
    for name, a_list, b_list in zip(("param", "grad", "master", "exp_avg", "exp_avg_sq"), kernel, twin):
        if name == "grad":
            continue
        differing = sum(int((a != b).sum()) for a, b in zip(a_list, b_list))
        rows.append(["master_adamw", f"{name} (elements unequal)", float(differing), 0.0,
                     "ok" if differing == 0 else "FAIL"])


def check_mla_flash(device, rows) -> None:
    if device.type != "cuda":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from k3.layers.mla import GatedMLA

    torch.manual_seed(8)
    config = ModelConfig.from_preset("small")
    layer = GatedMLA(config, 3).to(device, torch.bfloat16)
    x = torch.randn(2, 2048, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)

    def run():
        y = layer(x)
        return [y] + grads_of([y], [x, layer.kv_b_proj.weight], seed=9)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fast = run()  # raises if the flash kernel cannot take these inputs
    with sdpa_kernel([SDPBackend.MATH]):
        twin = run()
    compare("mla_flash", fast, twin, ["y", "dx", "dkv_b"], BF16_TOL, rows)


def wide_debug_config() -> ModelConfig:
    """The debug preset with widths that fla and the grouped GEMM accept (KDA heads as in `small`, multiples of 8)."""
    return ModelConfig.from_preset("debug", hidden_size=256, kda_num_heads=8, kda_head_dim=128, mla_num_heads=2,
                                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, kv_lora_rank=64,
                                   q_lora_rank=64, intermediate_size=512, moe_intermediate_size=128,
                                   moe_latent_size=128)


def check_model(device, rows) -> None:
    """Whole model, bf16, fast paths vs twins: logits, packed logits and every gradient.

    A bf16 router score that differs in its last bit between two paths can cross a top-k boundary and send a
    token to another expert; one flipped expert moves that token's logits by O(1), so free-routing runs of two
    correct paths differ by far more than the bf16 tolerance. So every comparison here replays the experts the
    fast run chose (k3.rl.routing); the flip rate and the free-routing errors are info rows.

    Even under the same routing, two bf16 runs of 8 layers differ by more than one op's bf16 rounding (each
    path rounds its intermediates differently and the differences compound, most in the gradients). The
    measure of a fast path is therefore its error against an fp32 run of the twins (same weights, same
    routing), next to the bf16 twin's own error against that reference: a fast path passes when it is within
    BF16_TOL of the reference, or no more than 1.5x as far from it as the bf16 twin is. Per-path rows switch
    one fast path to its twin at a time."""
    torch.manual_seed(10)
    model = K3ForCausalLM(wide_debug_config()).to(device, torch.bfloat16).train()
    for name, p in model.named_parameters():
        if name.endswith("res.proj.weight"):
            torch.nn.init.normal_(p, std=0.5)
    reference = copy.deepcopy(model).float()
    ids = torch.randint(0, model.config.vocab_size, (2, 300), device=device)
    cu = torch.tensor([0, 100, 137, 600], device=device)
    # QB solves the router biases inside every training forward: every run starts from the same biases.
    buffers = {name: b.clone() for name, b in model.named_buffers()}

    def run(m, routes=None):
        for name, b in m.named_buffers():
            b.copy_(buffers[name])
        replay = RoutingReplay(m)
        params = [p for p in m.parameters() if p.requires_grad]
        with replay.record() as seen, (replay.replay(routes) if routes is not None else contextlib.nullcontext()):
            out = m(ids, labels=ids)
            packed = m(ids.reshape(1, -1), cu_seqlens=cu).logits
            grads = torch.autograd.grad(out.loss, params, allow_unused=True)
        flat = torch.cat([g.float().flatten() for g in grads if g is not None])
        return [out.logits.float(), packed.float(), flat], seen

    labels = ["logits", "packed_logits", "all_grads"]
    fast, fast_routes = run(model)
    with twins(True):
        free, free_routes = run(model)
        twin, _ = run(model, fast_routes)
        ref, _ = run(reference, fast_routes)
    flips = sum((a != b).sum().item() for la, lb in zip(fast_routes, free_routes) for a, b in zip(la, lb))
    total = sum(a.numel() for la in fast_routes for a in la)
    rows.append(["model", "expert choices flipped (free routing)", flips / total, "-", "info"])
    for label, a, b in zip(labels, fast, free):
        rows.append(["model", f"{label}: fast vs twin, free routing", relative_error(a, b), "-", "info"])
    for label, a, b in zip(labels, fast, twin):
        rows.append(["model", f"{label}: fast vs twin, same routing", relative_error(a, b), "-", "info"])
    twin_err = [relative_error(b, r) for b, r in zip(twin, ref)]
    for label, e in zip(labels, twin_err):
        rows.append(["model", f"{label}: bf16 twin vs fp32 twin", e, "-", "info"])

    def against_reference(name, outputs):
        for label, a, r, bound in zip(labels, outputs, ref, twin_err):
            err = relative_error(a, r)
            tol = max(BF16_TOL, 1.5 * bound)
            rows.append([name, f"{label}: vs fp32 twin", err, round(tol, 4), "ok" if err <= tol else "FAIL"])

    against_reference("model[all fast]", fast)
    for path in PATHS:
        with twins(tuple(p for p in PATHS if p != path)):
            one, _ = run(model, fast_routes)
        against_reference(f"model[{path} fast only]", one)


def check_static_decode(device, rows) -> None:
    """Static-cache steps must equal HybridCache steps (same kernels); graph replay must equal eager steps.
    Against the full forward, bf16 decode differs by the chunked-vs-recurrent rounding (a few %), so that row
    is held to a looser bound plus argmax agreement."""
    from static_decode import CUDAGraphDecoder, StaticCache, decode_step

    torch.manual_seed(11)
    model = K3ForCausalLM(wide_debug_config()).to(device, torch.bfloat16).eval()
    prompt, new = 200, 24
    ids = torch.randint(0, model.config.vocab_size, (3, prompt + new), device=device)

    def prefilled():
        hybrid = model.new_cache(3)
        first = model(ids[:, :prompt], cache=hybrid).logits[:, -1]
        return hybrid, first

    with torch.no_grad():
        full = model(ids).logits[:, prompt - 1:]
        hybrid, first = prefilled()
        dynamic = torch.stack([first] + [model(ids[:, t:t + 1], cache=hybrid).logits[:, -1]
                                         for t in range(prompt, prompt + new)], 1)
        hybrid, first = prefilled()
        static = StaticCache.from_hybrid(model.config, hybrid, capacity=prompt + new)
        eager = torch.stack([first] + [decode_step(model, static, ids[:, t:t + 1])
                                       for t in range(prompt, prompt + new)], 1)
    compare("static_decode", [eager], [dynamic], ["static vs hybrid-cache steps"], BF16_TOL, rows)
    compare("static_decode", [dynamic], [full], ["hybrid steps vs full forward"], 0.1, rows)
    agree = (dynamic.argmax(-1) == full.argmax(-1)).float().mean().item()
    rows.append(["static_decode", "steps argmax == full argmax", agree, 0.9, "ok" if agree >= 0.9 else "FAIL"])
    if device.type != "cuda":
        return
    with torch.no_grad():
        hybrid, first = prefilled()
        static = StaticCache.from_hybrid(model.config, hybrid, capacity=prompt + new)
        decoder = CUDAGraphDecoder(model, static)
        graphed = torch.stack([first] + [decoder.step(ids[:, t:t + 1]).clone() for t in range(prompt, prompt + new)], 1)
        hybrid, first = prefilled()
        static = StaticCache.from_hybrid(model.config, hybrid, capacity=prompt + new)
        decoder = CUDAGraphDecoder(model, static)
        greedy = decoder.greedy(ids[:, prompt:prompt + 1], 8)
    compare("static_decode", [graphed], [eager], ["cuda graph vs eager steps"], 1e-3, rows)
    # Greedy tokens from graph replay, checked by re-running eagerly on the tokens it chose.
    with torch.no_grad():
        hybrid, _ = prefilled()
        fed = torch.cat([ids[:, prompt:prompt + 1], greedy[:, :-1]], 1)
        expect = model(fed, cache=hybrid).logits.argmax(-1)
    same = (expect == greedy).float().mean().item()
    rows.append(["static_decode", "graph greedy == eager argmax", same, 0.95, "ok" if same >= 0.95 else "FAIL"])
    # The step compiled by torch.compile (one graph, fla as k3:: custom ops) and captured: Inductor fuses the
    # elementwise chains in fp32 between bf16 kernels, so it rounds differently from the eager step (bf16 bound).
    with torch.no_grad():
        hybrid, first = prefilled()
        static = StaticCache.from_hybrid(model.config, hybrid, capacity=prompt + new)
        decoder = CUDAGraphDecoder(model, static, compile=True)
        compiled = torch.stack([first] + [decoder.step(ids[:, t:t + 1]).clone()
                                          for t in range(prompt, prompt + new)], 1)
    compare("static_decode", [compiled], [eager], ["compiled cuda graph vs eager steps"], BF16_TOL, rows)


def check_graphed_documents(device, rows) -> None:
    """The default CUDA training step: forward + backward captured as one CUDA graph with packed documents in
    static shapes (cu_seqlens padded to a fixed count: fla's graph mode, the convs by position, MLA masked per
    row), replayed on two batches with different document layouts, against the eager packed step (one SDPA call
    per document, fla's varlen chunk list built on the host). fp32 weights under bf16 autocast, as `k3 train`
    runs; tokens dealt to experts round-robin (Router.force_balanced), so that a last-bit difference in a router
    score cannot move a token to another expert (see check_model)."""
    if device.type != "cuda":
        rows.append(["graphed_documents", "skipped", "needs CUDA graphs", "", "info"])
        return
    from k3.model import pad_cu_seqlens
    from k3.train.graphed_step import GraphedTrainStep

    torch.manual_seed(11)
    eager = K3ForCausalLM(wide_debug_config()).to(device).train()
    graphed = copy.deepcopy(eager)
    for model in (eager, graphed):
        for _, router in model.routers():
            router.force_balanced = True
    rows_, length, max_docs = 2, 512, 16

    def loss_fn(model, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(batch["ids"], labels=batch["ids"], return_logits=False, cu_seqlens=batch["cu"],
                         max_documents=max_docs, row_length=length).loss

    layouts = [[0, 100, 137, 512, 700, 1024], [0, 1, 300, 512, 513, 514, 1000, 1024]]
    batches = [{"ids": torch.randint(0, eager.config.vocab_size, (1, rows_ * length), device=device),
                "cu": pad_cu_seqlens(torch.tensor(cu), max_docs).to(device)} for cu in layouts]
    step = GraphedTrainStep(graphed, loss_fn, batches[0])
    for index, (batch, cu) in enumerate(zip(batches, layouts)):
        eager.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = eager(batch["ids"], labels=batch["ids"], return_logits=False,
                         cu_seqlens=torch.tensor(cu, device=device)).loss
        want.backward()
        got = step(batch)
        names = [n for n, p in eager.named_parameters() if p.grad is not None]
        fast = [got] + [dict(graphed.named_parameters())[n].grad for n in names]
        twin = [want.detach()] + [dict(eager.named_parameters())[n].grad for n in names]
        errors = [relative_error(a, b) if a is not None else float("inf") for a, b in zip(fast, twin)]
        worst = max(range(1, len(errors)), key=errors.__getitem__)
        rows.append([f"graphed_documents[{index}]", "loss", errors[0], BF16_TOL,
                     "ok" if errors[0] <= BF16_TOL else "FAIL"])
        rows.append([f"graphed_documents[{index}]", f"worst grad ({names[worst - 1]})", errors[worst], BF16_TOL,
                     "ok" if errors[worst] <= BF16_TOL else "FAIL"])


CHECKS = [check_kda_chunk, check_kda_options, check_kda_recurrent, check_moe, check_attn_res, check_rms_norm, check_glu,
          check_router_logits, check_moe_combine, check_short_conv, check_adamw, check_master_adamw, check_mla_flash,
          check_model,
          check_static_decode, check_graphed_documents]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    names = [check.__name__.removeprefix("check_") for check in CHECKS]
    parser.add_argument("--checks", nargs="+", default=names, choices=names, metavar="NAME",
                        help=f"run only these checks (default: all of {', '.join(names)})")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows: list = []
    for check in [c for c in CHECKS if c.__name__.removeprefix("check_") in args.checks]:
        try:
            check(device, rows)
        except Exception as exc:  # report and go on: one broken path must not hide the others
            traceback.print_exc()
            rows.append([check.__name__.removeprefix("check_"), "error", f"{type(exc).__name__}: {exc}"[:120],
                         "", "FAIL"])
    print_table(f"CUDA paths vs PyTorch twins on {device}", ["path", "tensor", "rel err", "tol", "result"], rows)
    failed = [r for r in rows if r[-1] not in ("ok", "info")]
    print(f"\n{len(rows) - len(failed)} ok, {len(failed)} failed")
    write_json(args.out, {"checks": [dict(zip(["path", "tensor", "rel_err", "tol", "result"], r)) for r in rows]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
