import os

import pytest
import torch

if torch.cuda.is_available():
    # On a GPU with K3_AUTOTUNE_CONFIGS (or K3_BENCH_AUTOTUNE_CONFIGS) set (a kernel cache built with 4 sets 4),
    # fla's kernels autotune over that many configs, the set the cache holds, instead of compiling up to ~36 each
    # for the tests' shapes.
    from k3.ops.triton_support import limit_triton_autotune_from_env

    limit_triton_autotune_from_env()
else:
    # k3's own Triton kernels (k3.ops.moe_triton) run on CPU tensors in Triton's interpreter. It is chosen when
    # triton is imported, which importing k3 does, so it is set here, before any test module imports k3.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _nan_filled_empty():
    """Fill torch.empty with NaN so that code reading memory it never wrote fails loudly."""
    original = torch.empty

    def nan_empty(*args, **kwargs):
        # A patched function is not seen by `with torch.device(...)`: pass the context's device on.
        if kwargs.get("device") is None:
            kwargs["device"] = torch.get_default_device()
        tensor = original(*args, **kwargs)
        if tensor.is_floating_point() and tensor.device.type != "meta":
            with torch.no_grad():  # torch.empty(..., requires_grad=True) gives a leaf (Inductor's pattern setup)
                tensor.fill_(float("nan"))
        return tensor

    torch.empty = nan_empty
    yield
    torch.empty = original


def pytest_configure(config):
    os.environ.setdefault("K3_TEST", "1")
    # Test tensors are tiny: one thread avoids OpenMP spin-waiting, which is many times slower on a busy machine.
    torch.set_num_threads(1)
