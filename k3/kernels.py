"""Every kernel switch of k3, declared once: its environment variable, choices, default and why.

A switch picks between an op's fast paths and its PyTorch twin, which is always called `torch` (older names of
the twin, such as `eager`, `einsum` or `loop`, are still read as `torch`). On/off switches take 0 or 1.

The choice of a switch, at every call (so a test or bench that sets a variable takes effect at once):
  1. the innermost `use(name=choice)` block that names it (`reference()` names every switch, at its twin);
  2. else the choice pinned by `pin(name, choice)` (k3.ops.kda.set_kda_backend and its peers);
  3. else the environment variable, read here and nowhere else in k3;
  4. else the declared default.

    from k3 import kernels
    with kernels.use(moe="torch", glu="triton"):
        ...
    kernels.choice("moe")          # "auto" again here, unless K3_MOE_BACKEND says otherwise

`k3 info --kernels` prints the resolved table; docs/gpu.md's switch table is `k3 info --kernels --markdown`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

TWIN = "torch"
_FLAG_ALIASES = {"false": "0", "true": "1", "off": "0", "on": "1"}


@dataclass(frozen=True)
class Switch:
    """One kernel switch. `reference` is the choice `reference()` takes (the twin: "torch", or "0" for an on/off
    switch whose off state is the twin; None for a tuning knob that has no twin). `pattern` admits free-form
    values beside `choices` (a launch shape). `see` is the section of docs/history/benchmarks.md (the measurement log behind BENCHMARKS.md) with the measurements."""
    name: str
    env: str
    choices: tuple[str, ...]
    default: str
    reason: str
    see: str
    reference: str | None = TWIN
    aliases: Mapping[str, str] = field(default_factory=dict)
    pattern: str | None = None

    def canonical(self, value: str, source: str) -> str:
        """value as one of the choices (aliases resolved, case and spaces ignored); ValueError if it is none."""
        text = str(value).strip().lower()
        text = self.aliases.get(text, text)
        if text in self.choices or (self.pattern is not None and re.fullmatch(self.pattern, text)):
            return text
        options = list(self.choices) + (["BV,warps,stages"] if self.pattern else [])
        old = [alias for alias, target in self.aliases.items() if target == TWIN]
        twin = f"; {' and '.join(old)} also mean{'s' if len(old) == 1 else ''} torch" if old else ""
        raise ValueError(f"{source}={value!r}; use {', '.join(options[:-1])} or {options[-1]} (kernel switch "
                         f"{self.name!r} in k3/kernels.py{twin})")

    @property
    def link(self) -> str:
        return f"docs/history/benchmarks.md#{self.see}"


def _flag(name: str, env: str, default: str, reason: str, see: str, reference: str | None = "0") -> Switch:
    return Switch(name, env, ("0", "1"), default, reason, see, reference, _FLAG_ALIASES)


_R7 = "round-seven-attnres-and-moe-combine-kernels-for-training-the-engine-one-h200"
_R12 = "round-twelve-k3-launches-flas-recurrent-kda-kernel-the-decode-conv-step-as-one-kernel-one-h200"
_R16 = ("round-sixteen-k3s-short-conv-and-splitadamw-in-the-training-step-the-moe-combine-from-expert-order-"
        "one-h100-the-combine-on-one-h200")
_R17 = ("round-seventeen-fewer-gradient-additions-in-the-training-step-every-row-of-the-gpu-issue-re-measured-"
        "one-h100")
_DECODE5 = "decode-round-five-router-kernel-experts-in-pair-order-skinny-projections-one-h200"
_DECODE6 = "decode-round-six-norms-and-router-logits-left-to-inductor-one-h200"
_KDA_TRAIN = "2026-12-07-night-later-flas-kda-options-for-training-intermediates-kept-chunks-of-32-not-yet-timed"

SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("kda", "K3_KDA_BACKEND", ("auto", "torch", "fla"), "auto",
           "KDA's chunked and recurrent scans: fla's Triton kernels on CUDA, k3/ops/kda's PyTorch scans elsewhere",
           _R17),
    _flag("kda_keep", "K3_KDA_KEEP_INTERMEDIATES", "0",
          "training keeps fla's KDA intermediates for the backward, not recomputed: ~3.7 ms of kernels, untimed",
          _KDA_TRAIN),
    Switch("kda_chunk", "K3_KDA_CHUNK", ("64", "32"), "64",
           "fla's KDA chunk length in training: 64 (fla's default) or 32, untimed for `small`", _KDA_TRAIN,
           reference=None),
    Switch("kda_launch", "K3_KDA_RECURRENT_LAUNCH", ("auto", "fla"), "auto",
           "in-place decode launch of fla's recurrent KDA kernel: k3's blocks beat fla's launcher 27.5 -> 22.4 us",
           _R12, reference=None, pattern=r"\d+,\d+,\d+"),
    Switch("fused", "K3_FUSED_BACKEND", ("auto", "torch", "fla"), "auto",
           "fla's short-conv and norm kernels on CUDA; `torch` also sends conv, norms and GLU to their twins",
           _DECODE6),
    Switch("conv", "K3_CONV_BACKEND", ("auto", "torch", "fla", "triton"), "auto",
           "k3's short-conv kernels for training and prefill: 85/199 us against fla's 234/799 us",
           _R16),
    Switch("conv_step", "K3_CONV_STEP_BACKEND", ("auto", "torch", "triton"), "auto",
           "one-token conv step as one kernel on the cache in place: 7 kernels a KDA layer -> 1",
           _R12),
    Switch("rms_norm", "K3_RMS_NORM", ("auto", "torch", "triton", "fla"), "auto",
           "k3's RMSNorm kernels on CUDA: 1.4-1.9x the bytes' time where fla's took 2-14x",
           "round-eight-the-training-step-as-one-cuda-graph-k3s-rmsnorm-by-default-one-h200"),
    Switch("glu", "K3_GLU_BACKEND", ("auto", "torch", "compiled", "triton"), "auto",
           "GLU activation kernels in training: 0.52 ms forward + backward against the compiled formula's 0.70",
           "round-fifteen-the-glu-activation-as-triton-kernels-the-qb-radix-select-over-slices-one-h200",
           aliases={"formula": TWIN, "eager": TWIN}),
    Switch("attn_res", "K3_ATTN_RES_BACKEND", ("auto", "torch", "compiled", "triton"), "auto",
           "AttnRes mix kernels: 0.13-0.29 ms per mix against 0.81-1.82 ms for the compiled stack",
           _R7, aliases={"eager": TWIN}),
    _flag("attn_res_accumulate", "K3_ATTN_RES_ACCUMULATE", "1",
          "finished AttnRes sources' gradients summed in place, not by ~80 autograd additions a step", _R17),
    Switch("vector_grads", "K3_VECTOR_GRADS", ("torch", "triton"), "torch",
           "RMSNorm's and AttnRes' [D] weight gradients as one tiled kernel: 141.4 ms a step against torch's 141.0",
           "2026-12-07-later-1000-flat-steps-the-ablation-at-2000-steps-the-serving-baselines-one-h100"),
    _flag("join_projections", "K3_JOIN_PROJECTIONS", "1",
          "projections of one input as one GEMM in training, dx summed in the GEMM epilogue", _R17),
    Switch("linear", "K3_LINEAR_BACKEND", ("auto", "torch", "triton"), "auto",
           "skinny Triton GEMM for projections of a few rows: o_proj 7.5 -> 3.2 us at one token",
           _DECODE5),
    Switch("linear_ce", "K3_LINEAR_CE", ("auto", "torch", "fused", "chunked", "fla"), "auto",
           "LM head + loss: fused is 5.3 ms and 1.0 GiB against 10.7 ms and 5.9 GiB for torch's fp32 logits",
           "round-fourteen-the-training-steps-loss-gateup-gemms-and-qb-solver-one-h200",
           aliases={"plain": TWIN}),
    Switch("router", "K3_ROUTER_BACKEND", ("auto", "torch", "triton"), "auto",
           "inference routing (sigmoid, bias, top-k, weights) as one kernel",
           _DECODE5),
    Switch("route_weights", "K3_ROUTE_WEIGHTS", ("torch", "triton"), "torch",
           "the router's training gate weights as 2 kernels (forward, backward): 140.7 ms a step against torch's 141.0",
           "2026-12-07-later-1000-flat-steps-the-ablation-at-2000-steps-the-serving-baselines-one-h100"),
    Switch("router_logits", "K3_ROUTER_LOGITS", ("auto", "torch"), "auto",
           "router logits as bf16 GEMMs on CUDA where the twin computes them in fp32",
           _DECODE6, aliases={"fp32": TWIN}),
    Switch("qb", "K3_QB_BACKEND", ("auto", "torch", "triton"), "auto",
           "Quantile Balancing's selection and radix select as kernels: 4.5 -> 3.0 ms a `small` step",
           "round-fourteen-the-training-steps-loss-gateup-gemms-and-qb-solver-one-h200"),
    Switch("moe", "K3_MOE_BACKEND", ("auto", "torch", "grouped", "triton"), "auto",
           "experts as grouped GEMMs in training and Triton kernels in decode, where torch loops over experts",
           "decode-round-four-triton-experts-in-place-kda-states-counting-sort-one-h200",
           aliases={"loop": TWIN}),
    Switch("moe_combine", "K3_MOE_COMBINE", ("auto", "torch", "triton", "sum"), "auto",
           "weighted sum over a token's experts as kernels: 0.47 against 0.87 ms forward + backward",
           _R7, aliases={"bmm": TWIN}),
    _flag("moe_pair_lists", "K3_MOE_PAIR_LISTS", "0",
          "share the pair lists between the two decode expert kernels: within noise, so off", _R12),
    Switch("packed_attention", "K3_PACKED_ATTENTION", ("auto", "torch", "varlen"), "torch",
           "packed documents' attention as flash varlen, no row-sized mask: the twin until timed in the graphed step",
           "2026-12-07-later-1000-flat-steps-the-ablation-at-2000-steps-the-serving-baselines-one-h100"),
    Switch("mla_decode", "K3_MLA_DECODE", ("auto", "torch", "triton"), "auto",
           "flash-decode MLA kernel: 95 us a layer against the einsum's 232 at batch 64",
           "round-ten-mla-kernel-limits-moe-projections-fused-the-eager-trainer-profiled-one-h200",
           aliases={"einsum": TWIN}),
    Switch("adamw", "K3_ADAMW", ("auto", "torch", "triton"), "auto",
           "SplitAdamW's Triton kernel for large tensors: 10.2 ms a step against torch's fused 12.0",
           _R16),
    Switch("master_adamw", "K3_MASTER_ADAMW", ("auto", "torch", "triton"), "auto",
           "bf16 parameters' AdamW in one pass over fp32 masters: `k3 train`'s `small` step 155.4 against 171.7 ms",
           "2026-12-07-the-fused-master-adamw-as-the-default-and-the-cuda-tests-one-h100"),
    _flag("compile_decode", "K3_COMPILE_DECODE", "0",
          "the engine's decode step through torch.compile: faster, but about a minute to compile per graph",
          "compiled-decode-step-benchdecodepy---compile-one-h200"),
)}

# Variables the registry reads that are not kernel switches.
TRITON_INTERPRET = "TRITON_INTERPRET"  # Triton's CPU interpreter (tests on a machine without a GPU)
AUTOTUNE_ENV = "K3_AUTOTUNE_CONFIGS"
AUTOTUNE_ENV_BENCH = "K3_BENCH_AUTOTUNE_CONFIGS"  # the older name, still read
OTHER_VARIABLES = (TRITON_INTERPRET, AUTOTUNE_ENV, AUTOTUNE_ENV_BENCH)

_BY_ENV = {s.env: s for s in SWITCHES.values()}
_lock = threading.Lock()
_scopes: list[tuple[object, dict[str, str]]] = []  # use() blocks, innermost last
_pinned: dict[str, str] = {}


def switch(name: str) -> Switch:
    """The switch called `name` (or whose environment variable is `name`); ValueError naming them all if none."""
    found = SWITCHES.get(name) or _BY_ENV.get(name)
    if found is None:
        raise ValueError(f"unknown kernel switch {name!r}; the switches are {', '.join(SWITCHES)}")
    return found


def _from_environment(found: Switch) -> str | None:
    raw = os.environ.get(found.env)
    if raw is None or not raw.strip():
        return None
    return found.canonical(raw, found.env)


def choice(name: str) -> str:
    """The choice of switch `name` now (module docstring for the order)."""
    found = SWITCHES.get(name) or switch(name)
    for _, values in reversed(_scopes):
        if found.name in values:
            return values[found.name]
    if found.name in _pinned:
        return _pinned[found.name]
    from_env = _from_environment(found)
    return found.default if from_env is None else from_env


def enabled(name: str) -> bool:
    """An on/off switch's choice as a bool."""
    return choice(name) == "1"


def checked(choices: Mapping[str, Any] | None) -> dict[str, str]:
    """choices with every key a switch and every value one of its choices, canonical (aliases resolved);
    on/off switches also take True/False."""
    out = {}
    for name, value in (choices or {}).items():
        found = switch(name)
        if found.name != name:
            raise ValueError(f"name the kernel switch {found.name!r}, not its variable {name!r}")
        if isinstance(value, bool):
            value = "1" if value else "0"
        out[name] = found.canonical(value, name)
    return out


@contextlib.contextmanager
def use(**choices: Any) -> Iterator[None]:
    """Inside the block, the named switches take the given choices, over the environment and pins. Blocks nest;
    leaving one restores what was there, also when blocks of different threads close out of order."""
    values = checked(choices)
    if not values:  # nothing to change: leave the scopes (which torch.compile guards on) as they are
        yield
        return
    token = object()
    with _lock:
        _scopes.append((token, values))
    try:
        yield
    finally:
        with _lock:
            _scopes[:] = [scope for scope in _scopes if scope[0] is not token]


def reference() -> contextlib.AbstractContextManager[None]:
    """A use() block with every switch at its PyTorch twin (the fp32-faithful paths tests compare against)."""
    return use(**{s.name: s.reference for s in SWITCHES.values() if s.reference is not None})


def pin(name: str, value: str | None) -> None:
    """Pin switch `name` to value for the process, below use() blocks and over the environment; None unpins."""
    found = switch(name)
    with _lock:
        if value is None:
            _pinned.pop(found.name, None)
        else:
            _pinned[found.name] = found.canonical(value, f"{found.name} (pinned)")


T = TypeVar("T")


def applied(method: Callable[..., T]) -> Callable[..., T]:
    """A method run inside use(**self.kernels), for classes that take a `kernels=` mapping (Engine, Trainer): on
    __init__, self.kernels is first set from the `kernels` keyword argument, checked. Like the environment, the
    choices hold process-wide while the method runs."""
    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> T:
        if getattr(self, "kernels", None) is None:
            self.kernels = checked(kwargs.get("kernels"))
        if getattr(self, "_kernels_in_use", False):  # a nested call (train -> evaluate): the block is open
            return method(self, *args, **kwargs)
        self._kernels_in_use = True
        try:
            with use(**self.kernels):
                return method(self, *args, **kwargs)
        finally:
            self._kernels_in_use = False
    return wrapper


def source(name: str) -> str:
    """Where switch `name`'s choice comes from now: "use", "pin", the environment variable, or "default"."""
    if any(name in values for _, values in _scopes):
        return "use"
    if name in _pinned:
        return "pin"
    return switch(name).env if _from_environment(switch(name)) is not None else "default"


def resolved() -> list[dict[str, Any]]:
    """Every switch with its choice now and where that comes from (k3 info --kernels)."""
    return [{"name": s.name, "env": s.env, "choice": choice(s.name), "source": source(s.name),
             "default": s.default, "choices": list(s.choices) + (["BV,warps,stages"] if s.pattern else []),
             "reference": s.reference, "aliases": dict(s.aliases), "reason": s.reason, "see": s.link}
            for s in SWITCHES.values()]


def markdown_table(root: str = "../") -> str:
    """The declared switches as a Markdown table, BENCHMARKS.md linked from `root` (docs/gpu.md holds this text;
    a test keeps them equal)."""
    lines = ["| switch | variable | choices (default first) | twin | why (measurements) |",
             "| --- | --- | --- | --- | --- |"]
    for s in SWITCHES.values():
        choices = [s.default] + [c for c in s.choices if c != s.default]
        shown = ", ".join(f"`{c}`" for c in choices) + (", `BV,warps,stages`" if s.pattern else "")
        old = ", ".join(f"`{a}`" for a, target in s.aliases.items() if target == TWIN)
        twin = f"`{s.reference}`" if s.reference is not None else "-"
        twin += f" (also {old})" if old else ""
        lines.append(f"| `{s.name}` | `{s.env}` | {shown} | {twin} | {s.reason} ([BENCHMARKS]({root}{s.link})) |")
    return "\n".join(lines) + "\n"


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get(TRITON_INTERPRET, "0") == "1"


def autotune_configs() -> int | None:
    """N from K3_AUTOTUNE_CONFIGS (else K3_BENCH_AUTOTUNE_CONFIGS), None when neither is set."""
    for name in (AUTOTUNE_ENV, AUTOTUNE_ENV_BENCH):
        value = os.environ.get(name, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{name} must be a whole number of autotune configs >= 1, got {value!r}")
            return int(value)
    return None
