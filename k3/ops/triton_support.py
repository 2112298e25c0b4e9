"""What k3's own Triton kernels share: whether Triton is importable, whether it interprets on the CPU, and loading
a kernel module (k3 imports without triton; a kernel module imports it on first use).

Without a GPU the tests set TRITON_INTERPRET=1 (tests/conftest.py), and Triton then runs the same kernel source
in its CPU interpreter. Triton decides between compiling and interpreting when a function is decorated, so a
kernel module records the mode it was imported in (its INTERPRETED flag) and is reloaded on a change.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from k3 import kernels
from k3.ops.compile_constant import assume_constant_result


# Tags for a custom op whose kernel reads its inputs through their strides. Inductor's default for custom ops is
# to hand them the exact strides seen while tracing; on a GPU it pads the row stride of wide GEMM outputs (e.g.
# 4232 -> 4288 columns, a multiple of 128 bytes), so a column slice of one then reaches such an op through a copy
# kernel of its own (12 per `small` decode step for the conv step, 12 for KDA's f_b projection; on one H200,
# bench/results/decode_round12_h200/). With a flexible layout the op takes the padded slice as it lies.
ANY_STRIDES = (torch._C.Tag.flexible_layout,)


def interpreting() -> bool:
    return kernels.triton_interpreting()


def runs_kernels_on(device: torch.device) -> bool:
    """Whether k3's Triton kernels can run on `device`: CUDA, or the CPU in Triton's interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def kernel_backend(switch: str) -> str:
    """The choice of one of k3's own kernels' switches (k3.kernels; by name or environment variable)."""
    return kernels.choice(switch)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # a broken install raises more than ImportError
        return False
    return True


@assume_constant_result
def triton_importable() -> bool:
    """A constant to torch.compile (the import inside triton_available cannot be traced)."""
    return triton_available()


_loaded: dict = {}


def kernel_module(name: str, interpret: bool):
    """The kernel module `name` (e.g. "k3.ops.moe_triton_kernels"), imported in the given interpreter mode. The
    mode is checked on every call: a reload changes the one module object in place, so a cache keyed on the mode
    would hand back a module in the other mode after a switch there and back."""
    module = _loaded.get(name) or importlib.import_module(name)
    if module.INTERPRETED != interpret:
        module = importlib.reload(module)
    _loaded[name] = module
    return module


@dataclass(frozen=True)
class Blocks:
    """Launch shape of a kernel over rows: block_n rows per program, the row in chunks of block_d, num_warps; and,
    for a kernel whose programs loop over row blocks, how many programs (None: its launcher's rule)."""
    block_n: int
    block_d: int
    num_warps: int = 4
    programs: int | None = None


def pow2_width(dim: int) -> int:
    """The smallest power of two >= dim, at least 16: a block that covers a row of dim in one chunk."""
    return max(16, 1 << (dim - 1).bit_length())


@functools.lru_cache(maxsize=None)
def multiprocessors(device_index: int | None) -> int:
    """The device's multiprocessor count, looked up once (launchers run in every step)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def limit_triton_autotune(max_configs: int) -> None:
    """Keep at most `max_configs` evenly spaced configs in every triton.autotune declared after this call.

    fla's kernels each autotune over up to ~36 configs, and a fresh machine compiles every one of them: minutes
    of compilation before the first timed step. Called before fla is imported (importing k3 does not import
    it); k3 and the fla-based peers then run the same reduced kernel set."""
    import triton

    original = getattr(triton.autotune, "_k3_original", triton.autotune)

    def autotune(configs, key, *args, **kwargs):
        if len(configs) > max_configs:
            stride = len(configs) / max_configs
            configs = [configs[int(i * stride)] for i in range(max_configs)]
        return original(configs, key, *args, **kwargs)

    autotune._k3_original = original
    triton.autotune = autotune


autotune_configs_from_env = kernels.autotune_configs


def limit_triton_autotune_from_env() -> None:
    """limit_triton_autotune(N) when K3_AUTOTUNE_CONFIGS=N (or K3_BENCH_AUTOTUNE_CONFIGS=N) and a GPU is present.
    The CLI, the bench scripts and the test suite on a GPU call it: a first run on a fresh machine then compiles N
    configs per fla kernel instead of up to ~36 (minutes less before the first step, for kernels tuned over
    fewer configs), and a kernel cache built with the same N is found whole."""
    configs = autotune_configs_from_env()
    if configs is not None and torch.cuda.is_available():
        limit_triton_autotune(configs)
