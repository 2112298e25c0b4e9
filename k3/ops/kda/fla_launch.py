"""fla's fused recurrent KDA kernel, launched by k3 for the in-place decode step with a tile fitted to the batch.

fla 0.6.0's launcher (`fused_recurrent_kda_fwd`) always runs its kernel with BV = 32 value columns per program,
4 warps and 2 stages, and zero-fills the output first. On one H200 at `small`'s 8 heads of 128 x 128
(bench/kda_recurrent.py, BENCHMARKS.md round twelve), us per layer, fla's launch -> `auto_launch`: 27.5 -> 22.4 at
batch 64 (the floor, twice the state bytes, is 16.1), 9.6 -> 7.1 at 16, 5.2 -> 3.4 at 4, 4.8 -> 2.8 at 1; the
auto launch was the fastest of 19 at each of those batches (1 or 2 warps tie at 16). The kernel is the same; only
its tile and warps change, so the states agree to 1e-7 and the bf16 outputs to their last place.

`InplaceRecurrentLauncher` stands where k3 would call fla's launcher (k3.ops.kda.inplace) and takes the same
keywords. It launches fla's kernel itself for the one mode k3 uses (continuous batching, states in place, no
varlen, no speculative tokens) and hands anything else to fla's launcher. The output is allocated empty: every
(row, token, head, column) is written by the kernel, which returns early only for a zero-length row (varlen).

The launch: K3_KDA_RECURRENT_LAUNCH = "auto" (default: `auto_launch`), "fla" (fla's own launcher, as before), or
"BV,warps,stages" (say "16,2,2"), read at each call (a captured CUDA graph keeps the launch it captured).
"""

from __future__ import annotations

import torch

from k3 import kernels

_ENV = kernels.SWITCHES["kda_launch"].env

# The kernel arguments k3 passes by name; a kernel whose signature lacks one (another fla) is not launched here.
KERNEL_ARGS = frozenset({
    "q", "k", "v", "g", "beta", "A_log", "dt_bias", "o", "h0", "ht", "cu_seqlens", "ssm_state_indices",
    "num_accepted_tokens", "lower_bound", "scale", "N", "T", "H", "HV", "K", "V", "BK", "BV",
    "stride_init_state_token", "stride_final_state_token", "stride_indices_seq", "stride_indices_tok",
    "IS_BETA_HEADWISE", "USE_QK_L2NORM_IN_KERNEL", "INPLACE_FINAL_STATE", "USE_GATE_IN_KERNEL",
    "APPLY_BETA_SIGMOID", "ALLOW_NEG_EIGVAL", "STATE_V_FIRST"})


def auto_launch(batch: int) -> tuple[int, int, int]:
    """(BV, num_warps, num_stages) for a decode step of `batch` rows: BV 16 everywhere; 1 warp while there are few
    programs (each then holds a [128, 16] fp32 tile in 64 registers a thread), 2 once the batch fills the GPU."""
    return (16, 1, 2) if batch <= 8 else (16, 2, 2)


def launch_from_env(batch: int) -> tuple[int, int, int] | None:
    """The launch K3_KDA_RECURRENT_LAUNCH asks for at this batch; None for fla's own launcher."""
    value = kernels.choice("kda_launch")
    if value == "auto":
        return auto_launch(batch)
    if value == "fla":
        return None
    try:
        block_v, warps, stages = (int(part) for part in value.split(","))
    except ValueError:
        block_v = 0
    if block_v < 1 or block_v & (block_v - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"{_ENV}={value!r}: use auto, fla, or BV,warps,stages with BV a power of two "
                         "(say 16,2,2)")
    return block_v, warps, stages


def find_fla_recurrent_kernel(fla_kda) -> object | str:
    """fla's `fused_recurrent_kda_fwd_kernel` (the jitted kernel behind its recurrent launcher) when its
    signature takes every argument k3 passes, else why not as text."""
    kernel = getattr(getattr(fla_kda, "fused_recurrent", None), "fused_recurrent_kda_fwd_kernel", None)
    if kernel is None:
        return f"{fla_kda.__name__} has no fused_recurrent.fused_recurrent_kda_fwd_kernel"
    missing = KERNEL_ARGS - set(getattr(kernel, "arg_names", ()) or ())
    if missing:
        return f"fla's fused_recurrent_kda_fwd_kernel lacks {sorted(missing)}"
    return kernel


class InplaceRecurrentLauncher:
    """Called like fla's `fused_recurrent_kda_fwd`; launches `kernel` itself in the in-place continuous-batching
    mode with the launch K3_KDA_RECURRENT_LAUNCH picks, and calls `fla_fwd` for every other mode or launch."""

    def __init__(self, fla_fwd, kernel):
        self.fla_fwd, self.kernel = fla_fwd, kernel

    def __call__(self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                 output_final_state=False, inplace_final_state=True, ssm_state_indices=None,
                 use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                 lower_bound=None, **rest):
        ours = (inplace_final_state and ssm_state_indices is not None and initial_state is not None
                and not any(value is not None and value is not False for value in rest.values()))
        launch = launch_from_env(q.shape[0]) if ours else None
        if launch is None:
            return self.fla_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                                scale=scale, output_final_state=output_final_state,
                                inplace_final_state=inplace_final_state, ssm_state_indices=ssm_state_indices,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                use_gate_in_kernel=use_gate_in_kernel,
                                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound,
                                **rest)
        return self.launch(q, k, v, g, beta, A_log, dt_bias, initial_state, ssm_state_indices, scale,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound,
                           launch)

    def launch(self, q, k, v, g, beta, A_log, dt_bias, state_pool, indices, scale, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, launch) -> tuple[torch.Tensor,
                                                                                        torch.Tensor]:
        """fla's kernel over rows [B, T]: row n's state read from and written back to state_pool[indices[n, t]]
        after each token t (the arguments as fla's launcher computes them for this mode)."""
        block_v, warps, stages = launch
        B, T, H, K = k.shape
        HV, V = v.shape[2], v.shape[3]
        o = torch.empty_like(v)
        seq_stride = indices.stride(0)
        token_stride = 1 if indices.dim() == 1 else indices.stride(1)
        programs = (V + block_v - 1) // block_v * B * HV
        self.kernel[(programs,)](
            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, o=o, h0=state_pool, ht=state_pool,
            cu_seqlens=None, ssm_state_indices=indices, num_accepted_tokens=None, lower_bound=lower_bound,
            scale=K ** -0.5 if scale is None else scale, N=B, T=T, H=H, HV=HV, K=K, V=V,
            BK=1 << (K - 1).bit_length(), BV=block_v,
            stride_init_state_token=state_pool.stride(0), stride_final_state_token=state_pool.stride(0),
            stride_indices_seq=seq_stride, stride_indices_tok=token_stride,
            IS_BETA_HEADWISE=beta.dim() == v.dim(), USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
            INPLACE_FINAL_STATE=True, USE_GATE_IN_KERNEL=use_gate_in_kernel,
            APPLY_BETA_SIGMOID=use_beta_sigmoid_in_kernel, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False,
            num_warps=warps, num_stages=stages)
        return o, state_pool
