"""bench/train.py's trainer-shaped batches: `-packed` documents (cu_seqlens) and the step it times, on CPU with
the debug model (the bench itself needs a GPU)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def train_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports its neighbours by bare name
    return importlib.import_module("train")


def test_packed_documents_fill_the_row_with_fixed_seed_documents(train_bench):
    ids, cu = train_bench.packed_documents(4, 4096, 1000, "cpu")
    assert ids.shape == (1, 16384) and int(ids.max()) < 1000 and cu.dtype == torch.int32
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert cu[0] == 0 and cu[-1] == 16384 and all(256 <= n <= 4096 for n in lengths[:-1]) and lengths[-1] > 0
    assert len(lengths) >= 4  # several documents, so the varlen paths really split the row
    again, cu_again = train_bench.packed_documents(4, 4096, 1000, "cpu")
    assert torch.equal(ids, again) and torch.equal(cu, cu_again)


def test_packed_step_keeps_documents_apart(train_bench):
    """The loss k3_loss computes over a packed row is the model's cu_seqlens loss, not the unpacked row's."""
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).train()
    ids, cu = train_bench.packed_documents(2, 1024, model.config.vocab_size, "cpu", seed=2)
    assert len(cu) > 2
    packed = train_bench.k3_loss(model, {"ids": ids, "cu_seqlens": cu})
    torch.testing.assert_close(packed, model(ids, cu_seqlens=cu, labels=ids, return_logits=False).loss)
    # The second document's start sees nothing of the first when packed. (In eval mode: training routes with
    # QB's bias solved over the whole batch, so a document alone would route differently.)
    with torch.no_grad():
        model.eval()
        start = int(cu[1])
        apart = model(ids, cu_seqlens=cu).logits[0, start:start + 8]
        alone = model(ids[:, start:start + 8]).logits[0]
        joined = model(ids).logits[0, start:start + 8]
    torch.testing.assert_close(apart, alone, rtol=1e-4, atol=1e-4)
    assert (joined - alone).abs().max() > 1e-3
    model.train()
    step = train_bench.step_fn(model, ids, True, extra={"cu_seqlens": cu})
    first = float(step())
    assert first == pytest.approx(float(packed), rel=1e-6) and float(step()) != first  # the step updates weights
    with pytest.raises(ValueError, match="unpacked rows"):
        train_bench.step_fn(model, ids, True, graphed=True, extra={"cu_seqlens": cu})


@pytest.mark.parametrize("name, backend", [("k3-small-graphed-step", "auto"), ("k3-small-eager-glu", "torch"),
                                           ("k3-small-graphed-step-compiled-glu", "compiled")])
def test_variant_suffixes_pick_the_glu_path_and_restore_it(train_bench, monkeypatch, name, backend):
    from k3.ops.glu import glu_backend

    monkeypatch.delenv("K3_GLU_BACKEND", raising=False)
    with train_bench.variant_settings(name):
        assert glu_backend() == backend
    assert "K3_GLU_BACKEND" not in os.environ


@pytest.mark.parametrize("name, expected", [("k3-small", "SplitAdamW"), ("k3-small-torch-adamw", "AdamW"),
                                            ("k3-small-torch-adamw-packed", "AdamW")])
def test_torch_adamw_suffix_picks_the_optimizer_and_restores_it(train_bench, monkeypatch, name, expected):
    """-torch-adamw sets K3_ADAMW=torch for its variant: the optimizer build_optimizer picks where torch's fused
    AdamW pays (on CUDA; forced here, the test being on CPU) is torch's, else SplitAdamW. The step bench/train.py
    times records its optimizer."""
    pytest.importorskip("triton")
    from k3.train import optim

    monkeypatch.delenv("K3_ADAMW", raising=False)
    monkeypatch.setattr(optim, "fused_pays", lambda params: True)
    model = torch.nn.Linear(4, 4)
    with train_bench.variant_settings(name):
        step = train_bench.step_fn(model, torch.zeros(1, 4, dtype=torch.long), True)
    assert type(step.optimizer).__name__ == expected
    assert "K3_ADAMW" not in os.environ


def test_kernel_families_sum_every_kernel_once_into_its_first_matching_family(train_bench):
    kernels = [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 6000.0, 90),
               ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x", 9000.0, 45),
               ("chunk_kda_bwd_kernel_wy_dqkg_fused", 9300.0, 12),
               ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::nat", 700.0, 8),
               ("glu_backward", 6200.0, 31),
               ("kth_radix_pass", 3000.0, 240),
               ("some_new_kernel", 50.0, 1)]
    rows = {family: (us, n) for family, us, n in train_bench.kernel_families(kernels)}
    assert rows["GEMM (cuBLAS nvjet, cutlass grouped)"] == (15000.0, 135)
    assert rows["KDA (fla kernels)"] == (9300.0, 12)  # not the "chunk" of the copy kernel's name
    assert rows["PyTorch elementwise, reductions, copies"] == (700.0, 8)
    assert rows["other"] == (50.0, 1)
    assert sum(us for us, _ in rows.values()) == sum(us for _, us, _ in kernels)
    table = train_bench.families_table(kernels, step_ms=35.0)
    assert "all kernels" in table and "34.25" in table and "35.00" in table
