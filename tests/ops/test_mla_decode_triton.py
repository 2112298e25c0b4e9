"""MLA's flash-decode Triton kernel (k3.ops.mla_decode) against its einsum twin.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton
is imported): the same source the GPU compiles, with small slot blocks (BLOCK_S 16) so that a few dozen slots
span several blocks, several KV splits and a ragged tail. Every mask form the callers pass is built by the
callers' own code (StaticMLASlot, MLAView). The last test compiles the kernels on CUDA in bf16.
"""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter")

from k3.cache import MLACacheSlot  # noqa: E402
from k3.config import ModelConfig  # noqa: E402
from k3.infer.cache_pool import CachePool, MLAView  # noqa: E402
from bench.static_decode import StaticMLASlot  # noqa: E402
from k3.layers.mla import GatedMLA  # noqa: E402
from k3.ops import mla_decode  # noqa: E402
from k3.ops.mla_decode import latent_attention_einsum, latent_attention_triton_eager, visible_before  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
SCALE = 0.3


def _inputs(batch, heads, length, rank, rope, total, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, length, rank, generator=g), torch.randn(batch, length, heads, rope, generator=g),
            torch.randn(batch, total, rank, generator=g), torch.randn(batch, total, rope, generator=g))


def _kernel(q, qr, lat, kr, mask, past, **blocks):
    return latent_attention_triton_eager(q, qr, lat, kr, mask, visible_before(past, q.shape[2]), SCALE,
                                         **{"block_s": 16, **blocks})


@interpreted
@pytest.mark.parametrize("batch,heads,rank,rope,total", [(1, 1, 48, 8, 70), (3, 3, 48, 16, 53), (2, 8, 64, 16, 64),
                                                         (2, 3, 32, 8, 5)])
@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_causal_equals_einsum(batch, heads, rank, rope, total, length, splits):
    """No mask: causal after `past` cached slots (past > 0), the plain lower triangle (past 0, several queries),
    every slot (past 0, one query). Widths no power of two, tails no multiple of BLOCK_S, 1 and several splits."""
    q, qr, lat, kr = _inputs(batch, heads, length, rank, rope, total)
    for past in sorted({0, total - length}):
        if past == 0 and length > 1 and total != length:
            continue  # the einsum twin's plain lower triangle is meant for total == length (no cache yet)
        want = latent_attention_einsum(q, qr, lat, kr, None, past, SCALE)
        got = _kernel(q, qr, lat, kr, None, past, splits=splits)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **TOL)


@interpreted
@pytest.mark.parametrize("form", ["TS", "1TS", "B1TS"])
@pytest.mark.parametrize("splits", [None, 4])
def test_arbitrary_boolean_masks(form, splits):
    """Masks with holes (not a prefix), read through strides, broadcast over rows for [T, S]."""
    batch, heads, length, rank, rope, total = 3, 3, 2, 48, 8, 75
    q, qr, lat, kr = _inputs(batch, heads, length, rank, rope, total, seed=1)
    g = torch.Generator().manual_seed(2)
    shape = {"TS": (length, total), "1TS": (1, 1, length, total), "B1TS": (batch, 1, length, total)}[form]
    mask = torch.rand(shape, generator=g) < 0.6
    mask[..., 7] = True  # no row without a visible slot
    want = latent_attention_einsum(q, qr, lat, kr, mask, 0, SCALE)
    torch.testing.assert_close(_kernel(q, qr, lat, kr, mask, 0, splits=splits), want, **TOL)


def _config(**overrides):
    return ModelConfig.from_preset("debug", mla_num_heads=3, kv_lora_rank=48, qk_rope_head_dim=8, **overrides)


def _half_filled_slot(batch: int, length: int, seed: int, capacity: int = 83, filled: int = 37):
    """A StaticMLASlot with `filled` slots of values, NaN after them, then `length` tokens appended: (slot,
    (q_latent, q_rope, latent, k_rope)) as the layer would pass them to the kernel."""
    slot = StaticMLASlot(_config(), batch, capacity, torch.tensor(filled), torch.device("cpu"), torch.float32)
    q, qr, lat, kr = _inputs(batch, 3, length, 48, 8, capacity, seed=seed)
    slot.latent[:, :filled], slot.k_rope[:, :filled] = lat[:, :filled], kr[:, :filled]
    slot.latent[:, filled:], slot.k_rope[:, filled:] = float("nan"), float("nan")
    latent, k_rope = slot.append(lat[:, filled:filled + length], kr[:, filled:filled + length])
    return slot, (q, qr, latent, k_rope)


@interpreted
@pytest.mark.parametrize("length", [1, 2])
def test_static_cache_mask_hides_the_unfilled_capacity(length):
    """StaticMLASlot's [T, capacity] mask, computed on the device from its position. The unfilled slots hold
    NaN: the kernel never loads them (the einsum twin, whose zero probabilities multiply them, would be NaN)."""
    slot, (q, qr, latent, k_rope) = _half_filled_slot(batch=2, length=length, seed=3)
    mask = slot.visible_mask
    assert mask.shape == (length, slot.latent.shape[1])
    got = _kernel(q, qr, latent, k_rope, mask, 0, splits=3)
    assert torch.isfinite(got).all()
    clean = [t.nan_to_num(0.0) for t in (latent, k_rope)]
    torch.testing.assert_close(got, latent_attention_einsum(q, qr, *clean, mask, 0, SCALE), **TOL)


@interpreted
@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("splits", [None, 3])
def test_static_cache_limits_equal_its_mask(length, splits):
    """StaticMLASlot's visible_limits (one [B] position broadcast with stride 0) are its mask in the kernel's
    other form: the same output, with the unfilled NaN capacity never visited."""
    batch = 3
    slot, (q, qr, latent, k_rope) = _half_filled_slot(batch=batch, length=length, seed=4)
    limits = slot.visible_limits
    assert limits.shape == (batch,) and limits.stride() == (0,) and limits.dtype == torch.int32
    by_mask = _kernel(q, qr, latent, k_rope, slot.visible_mask, 0, splits=splits)
    by_limits = _kernel(q, qr, latent, k_rope, None, 0, splits=splits, limits_B=limits)
    assert torch.isfinite(by_limits).all()
    torch.testing.assert_close(by_limits, by_mask, **TOL)
    with pytest.raises(ValueError, match="not both"):
        _kernel(q, qr, latent, k_rope, slot.visible_mask, 0, limits_B=limits)
    with pytest.raises(ValueError, match=r"limits_B must be \[B\]"):
        _kernel(q, qr, latent, k_rope, None, 0, limits_B=limits[:2])


@interpreted
def test_limits_per_row():
    """Rows at different positions in one launch (a [B] of distinct limits, contiguous)."""
    q, qr, lat, kr = _inputs(3, 2, 1, 32, 8, 50, seed=5)
    limits = torch.tensor([50, 17, 33], dtype=torch.int32)
    got = _kernel(q, qr, lat, kr, None, 0, splits=2, limits_B=limits)
    for b, limit in enumerate(limits.tolist()):
        want = latent_attention_einsum(q[b:b + 1], qr[b:b + 1], lat[b:b + 1, :limit], kr[b:b + 1, :limit], None, 0,
                                       SCALE)
        torch.testing.assert_close(got[b:b + 1], want, **TOL)


def _pool(config, batch, page_size=8, pages_per_row=6):
    """A cache pool of random contents and a page table giving each row its own shuffled pages."""
    pool = CachePool(config, num_slots=batch, num_pages=batch * pages_per_row, page_size=page_size,
                     device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    pool.latent.copy_(torch.randn(pool.latent.shape, generator=g))
    pool.k_rope.copy_(torch.randn(pool.k_rope.shape, generator=g))
    table = 1 + torch.randperm(batch * pages_per_row, generator=g).view(batch, pages_per_row)
    return pool, table


def _view(config, pool, table, positions):
    """The engine's decode adapter (mask_rows): every row at its own position."""
    return MLAView(pool, config.layer_types.index("mla"), table, torch.tensor(positions), mask_rows=True)


@interpreted
@pytest.mark.parametrize("length", [1, 2])
def test_pool_mask_rows_at_their_own_positions(length):
    """MLAView's [B, 1, T, S] mask: each row at a different position (one within the first block, one in the
    last of several splits, one at a page boundary)."""
    config = _config()
    view = _view(config, *_pool(config, 3), [3, 40, 15])
    g = torch.Generator().manual_seed(5)
    latent, k_rope = view.append(torch.randn(3, length, 48, generator=g), torch.randn(3, length, 8, generator=g))
    mask = view.visible_mask
    assert mask.shape == (3, 1, length, latent.shape[1])
    q, qr = _inputs(3, 3, length, 48, 8, 1, seed=6)[:2]
    want = latent_attention_einsum(q, qr, latent, k_rope, mask, 0, SCALE)
    for splits in (None, 1, 3):
        torch.testing.assert_close(_kernel(q, qr, latent, k_rope, mask, 0, splits=splits), want, **TOL)


@interpreted
@pytest.mark.parametrize("page_size", [8, 32])
@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_paged_kernel_reads_the_pool_in_place(page_size, length, splits):
    """The kernel over the pool's pages (k3::mla_decode_paged_triton) against the twin that gathers them: rows at
    their own positions (at 0, inside the first block, at a page boundary, in the last page), tables padded with
    the scratch page, slot blocks of 16 spanning two pages (page 8) or a part of one (page 32). Every slot past a
    row's position holds NaN: the kernel never reads it, where the twin's zero probabilities would not hide it."""
    config = _config()
    batch, pages_per_row = 4, 3
    pool, table = _pool(config, batch, page_size=page_size, pages_per_row=pages_per_row)
    table = torch.cat([table, torch.zeros(batch, 2, dtype=torch.long)], 1)  # padding: the scratch page
    positions = torch.tensor([0, 5, page_size - length, pages_per_row * page_size - length])
    n = config.layer_types.index("mla")
    view = MLAView(pool, n, table, positions, mask_rows=True)
    g = torch.Generator().manual_seed(11)
    new_latent, new_rope = torch.randn(batch, length, 48, generator=g), torch.randn(batch, length, 8, generator=g)
    pages = view.append_in_place(new_latent, new_rope)
    clean = mla_decode.PagedLatents(pages.latent_NPR.clone(), pages.k_rope_NPE.clone(), table, positions)
    for row in range(batch):  # poison everything the row may not see, in its own pages and the scratch page
        flat = table[row, :, None] * page_size + torch.arange(page_size)
        hidden = flat.reshape(-1)[positions[row] + length:]
        pool.latent[pool.mla_index[n]].view(-1, 48)[hidden] = float("nan")
        pool.k_rope[pool.mla_index[n]].view(-1, 8)[hidden] = float("nan")
    q, qr = _inputs(batch, 3, length, 48, 8, 1, seed=12)[:2]
    want = mla_decode.latent_attention_paged_einsum(q, qr, clean, SCALE)
    got = mla_decode.latent_attention_paged_triton_eager(q, qr, *pages, SCALE, block_s=16, splits=splits)
    assert got.shape == want.shape and not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL)


def test_paged_twin_is_the_gathered_path():
    """latent_attention_paged_einsum over a view's pages equals latent_attention_einsum over what the view's
    append gathers and masks: the engine's numbers on the default (einsum) path do not move."""
    config = _config()
    pool, table = _pool(config, 3)
    positions = [3, 40, 15]
    g = torch.Generator().manual_seed(13)
    latent, k_rope = torch.randn(3, 1, 48, generator=g), torch.randn(3, 1, 8, generator=g)
    gathered_view = _view(config, pool, table, positions)
    lat, kr = gathered_view.append(latent, k_rope)
    q, qr = _inputs(3, 3, 1, 48, 8, 1, seed=14)[:2]
    want = latent_attention_einsum(q, qr, lat, kr, gathered_view.visible_mask, 0, SCALE)
    pages = _view(config, pool, table, positions).append_in_place(latent, k_rope)
    assert torch.equal(mla_decode.latent_attention_paged_einsum(q, qr, pages, SCALE), want)


def test_paged_kernel_refuses_a_pool_of_another_dtype():
    config = _config()
    pool, table = _pool(config, 2)
    pages = mla_decode.PagedLatents(pool.latent[0], pool.k_rope[0], table, torch.tensor([1, 2]))
    q, qr = (t.double() for t in _inputs(2, 3, 1, 48, 8, 1)[:2])
    with pytest.raises(ValueError, match="the pool holds torch.float32"):
        mla_decode.latent_attention_paged_triton_eager(q, qr, *pages, SCALE)
    with pytest.raises(ValueError, match="do not agree"):
        mla_decode.latent_attention_paged_triton_eager(q.float()[:1], qr.float(), *pages, SCALE)


@interpreted
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the interpreter's numpy says 0 / 0
@pytest.mark.parametrize("splits", [1, 3])
def test_a_row_with_no_visible_slot_is_nan_as_in_the_einsum_path(splits):
    """Decode never hides every slot of a row; if it happens, both paths give NaN for that row (0 / 0 in the
    kernel, a softmax over all -inf in the twin) and the other rows are unaffected."""
    q, qr, lat, kr = _inputs(2, 3, 1, 48, 8, 40, seed=7)
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1] = False
    want = latent_attention_einsum(q, qr, lat, kr, mask, 0, SCALE)
    got = _kernel(q, qr, lat, kr, mask, 0, splits=splits)
    assert want[1].isnan().all() and got[1].isnan().all()
    torch.testing.assert_close(got[0], want[0], **TOL)


def test_split_count_fills_the_gpu():
    rows = 64  # small at batch 64, one query each, one head block
    splits, per_split = mla_decode.num_splits(rows, 8192, 64)
    assert rows * splits >= 132 and splits * per_split * 64 >= 8192
    splits, per_split = mla_decode.num_splits(1, 131072, 64)
    assert splits >= 132 and per_split >= 2 and splits * per_split * 64 >= 131072
    assert mla_decode.num_splits(1, 100, 64) == (1, 2)  # too short to split
    assert mla_decode.num_splits(512, 131072, 64)[0] == 1  # enough rows alone
    # A batch of rows takes 16-slot blocks and aims at four programs per multiprocessor; one row, 128 slots, two.
    assert mla_decode.default_block_s(rows, 256) == 16 and mla_decode.default_block_s(1, 256) == 128
    assert mla_decode.default_block_s(rows, 512) == 32  # wider latents: registers
    splits, per_split = mla_decode.num_splits(rows, 8192, 16, 132, mla_decode.programs_per_sm(16))
    assert rows * splits >= 4 * 132 and splits * per_split * 16 >= 8192
    assert mla_decode.programs_per_sm(128) == 2


def test_bad_masks_are_refused():
    q, qr, lat, kr = _inputs(2, 3, 1, 16, 8, 10)
    with pytest.raises(ValueError, match="one for all heads"):
        mla_decode.mask_BTS(torch.ones(2, 3, 1, 10, dtype=torch.bool), 2, 1, 10)
    with pytest.raises(ValueError, match=r"\[T, S\] or \[B, 1, T, S\]"):
        mla_decode.mask_BTS(torch.ones(2, 1, 10, dtype=torch.bool), 2, 1, 10)
    with pytest.raises(ValueError, match="boolean"):
        mla_decode.mask_BTS(torch.ones(1, 10), 2, 1, 10)
    with pytest.raises(ValueError, match="broadcast"):
        mla_decode.mask_BTS(torch.ones(1, 9, dtype=torch.bool), 2, 1, 10)


def _layer(config):
    torch.manual_seed(0)
    return GatedMLA(config, config.layer_types.index("mla")).eval()


def _count_kernel_calls(monkeypatch) -> list:
    """The query shapes of every kernel launch, over gathered latents or over the pool's pages."""
    calls = []
    for name in ("latent_attention_triton_eager", "latent_attention_paged_triton_eager"):
        kernel = getattr(mla_decode, name)
        monkeypatch.setattr(mla_decode, name, lambda *args, _kernel=kernel, **kw: calls.append(args[0].shape)
                            or _kernel(*args, **kw))
    return calls


def _decode_both_ways(monkeypatch, run):
    """run() under K3_MLA_DECODE=einsum and =triton, counting the kernel's launches."""
    calls = _count_kernel_calls(monkeypatch)
    with torch.no_grad():
        monkeypatch.setenv("K3_MLA_DECODE", "einsum")
        want = run()
        assert not calls
        monkeypatch.setenv("K3_MLA_DECODE", "triton")
        got = run()
    assert calls
    return got, want, calls


@interpreted
@pytest.mark.parametrize("cache_kind", ["hybrid", "static", "pool"])
def test_mla_layer_through_the_switch(monkeypatch, cache_kind):
    """The layer's decode (one token, then two) with each cache the callers use: same outputs as the einsum."""
    config = _config()
    layer = _layer(config)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randn(2, 9, config.hidden_size, generator=g)
    steps = [torch.randn(2, n, config.hidden_size, generator=g) for n in (1, 2)]

    def run():
        if cache_kind == "hybrid":
            cache = MLACacheSlot()
        elif cache_kind == "static":
            cache = StaticMLASlot(config, 2, 32, torch.tensor(0), torch.device("cpu"), torch.float32)
        else:
            pool, table = _pool(config, 2, page_size=4)
        outs = []
        for i, x in enumerate([prompt] + steps):
            if cache_kind == "static":
                outs.append(layer(x, cache))
                cache.position += x.shape[1]
            elif cache_kind == "pool":
                done = sum(s.shape[1] for s in ([prompt] + steps)[:i])
                outs.append(layer(x, _view(config, pool, table, [done, done + 5])))  # row 1: 5 slots more
            else:
                outs.append(layer(x, cache))
        return outs

    got, want, _ = _decode_both_ways(monkeypatch, run)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


@interpreted
def test_custom_op_under_compile(monkeypatch):
    """Dynamo keeps the launcher opaque (k3::mla_decode_triton, full graph) and its fake gives the right shape."""
    config = _config()
    layer = _layer(config)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randn(2, 11, config.hidden_size, generator=g)
    x = torch.randn(2, 1, config.hidden_size, generator=g)
    with torch.no_grad():
        cache = StaticMLASlot(config, 2, 24, torch.tensor(0), torch.device("cpu"), torch.float32)
        layer(prompt, cache)
        cache.position += prompt.shape[1]
    saved = [t.clone() for t in cache.buffers()]

    def step(x):
        for buffer, value in zip(cache.buffers(), saved):
            buffer.copy_(value)
        return layer(x, cache)

    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        monkeypatch.setenv("K3_MLA_DECODE", "einsum")
        want = step(x)
        monkeypatch.setenv("K3_MLA_DECODE", "triton")
        got = torch.compile(step, backend=backend, fullgraph=True)(x)
    assert len(graphs) == 1 and "mla_decode_triton" in graphs[0]
    torch.testing.assert_close(got, want, **TOL)


@interpreted
def test_paged_custom_op_under_compile(monkeypatch):
    """The pool's decode under torch.compile: one graph holding k3::mla_decode_paged_triton, same output."""
    config = _config()
    layer = _layer(config)
    pool, table = _pool(config, 2, page_size=4)
    x = torch.randn(2, 1, config.hidden_size, generator=torch.Generator().manual_seed(15))
    saved = [t.clone() for t in (pool.latent, pool.k_rope)]

    def step(x):
        pool.latent.copy_(saved[0])
        pool.k_rope.copy_(saved[1])
        return layer(x, _view(config, pool, table, [6, 13]))

    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        monkeypatch.setenv("K3_MLA_DECODE", "einsum")
        want = step(x)
        monkeypatch.setenv("K3_MLA_DECODE", "triton")
        got = torch.compile(step, backend=backend, fullgraph=True)(x)
    assert len(graphs) == 1 and "mla_decode_paged_triton" in graphs[0]
    torch.testing.assert_close(got, want, **TOL)


def test_auto_keeps_cpu_and_training_on_the_einsum(monkeypatch):
    """auto: CPU tensors, fp32, a graph for backward, or too many queries keep the twin (training unchanged)."""
    q, qr, lat, kr = _inputs(1, 3, 1, 16, 8, 10)
    monkeypatch.setattr(mla_decode, "triton_importable", lambda: True)
    assert not mla_decode.triton_pays(q, lat, None)
    monkeypatch.setenv("K3_MLA_DECODE", "auto")
    monkeypatch.setattr(mla_decode, "latent_attention_triton", lambda *args: pytest.fail("took the kernel"))
    config = _config()
    layer = _layer(config).train()
    cache = MLACacheSlot()
    layer(torch.randn(1, 4, config.hidden_size), cache)
    layer(torch.randn(1, 1, config.hidden_size), cache).sum().backward()
    assert layer.kv_b_proj.weight.grad is not None
    monkeypatch.setenv("K3_MLA_DECODE", "flash")
    with pytest.raises(ValueError, match="K3_MLA_DECODE"):
        layer(torch.randn(1, 1, config.hidden_size), cache)


def test_auto_selection_on_cuda_like_tensors(monkeypatch):
    """What auto asks of a tensor, checked through a stand-in that says it is on CUDA."""
    monkeypatch.setattr(mla_decode, "triton_importable", lambda: True)

    class Cuda(torch.Tensor):
        is_cuda = True

    q = torch.zeros(2, 3, 1, 16, dtype=torch.bfloat16).as_subclass(Cuda)
    lat = torch.zeros(2, 10, 16, dtype=torch.bfloat16)
    assert mla_decode.triton_pays(q, lat, None)
    assert mla_decode.triton_pays(q, lat, torch.ones(1, 10, dtype=torch.bool))
    assert mla_decode.triton_pays(q, lat, torch.ones(2, 1, 1, 10, dtype=torch.bool))
    assert not mla_decode.triton_pays(q, lat, torch.ones(2, 3, 1, 10, dtype=torch.bool))  # per-head mask
    assert not mla_decode.triton_pays(q.float(), lat, None)
    long_q = torch.zeros(2, 3, mla_decode.DECODE_MAX_TOKENS + 1, 16, dtype=torch.bfloat16).as_subclass(Cuda)
    assert not mla_decode.triton_pays(long_q, lat, None)
    assert not mla_decode.triton_pays(q, lat.requires_grad_(), None)


def test_a_kernel_triton_cannot_compile_falls_back_once(monkeypatch):
    """Auto-selected (not forced), a Triton compile failure warns once and that variant runs the einsum."""
    class CompilationError(Exception):  # the name Triton's compiler errors carry
        pass

    calls = []

    def failing(*args):
        calls.append(1)
        raise CompilationError("out of resource: shared memory")

    monkeypatch.setattr(mla_decode, "triton_pays", lambda *args: True)
    monkeypatch.setattr(mla_decode, "latent_attention_triton", failing)
    monkeypatch.setenv("K3_MLA_DECODE", "auto")
    monkeypatch.setattr("k3.ops.fused_backend._failed", {})
    q, qr, lat, kr = _inputs(2, 3, 1, 16, 8, 10)
    want = latent_attention_einsum(q, qr, lat, kr, None, 9, SCALE)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        got = mla_decode.latent_attention(q, qr, lat, kr, None, 9, SCALE)
    torch.testing.assert_close(got, want)
    mla_decode.latent_attention(q, qr, lat, kr, None, 9, SCALE)
    assert len(calls) == 1
    monkeypatch.setenv("K3_MLA_DECODE", "triton")  # forced: raises
    with pytest.raises(CompilationError):
        mla_decode.latent_attention(q, qr, lat, kr, None, 9, SCALE)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("form", ["causal", "TS", "B1TS"])
def test_kernel_equals_einsum_cuda_bf16(length, form):
    """`small`'s widths (8 heads, R 256, rope 64), several splits, in bf16 against the fp32 einsum; the bf16
    einsum's own distance from it bounds the kernel's."""
    batch, total, past = 4, 3000, 2990
    q, qr, lat, kr = (t.cuda() for t in _inputs(batch, 8, length, 256, 64, total, seed=10))
    q = q / 16
    mask = None
    if form == "TS":
        mask = torch.arange(total, device="cuda")[None] < (past + 1 + torch.arange(length, device="cuda"))[:, None]
    elif form == "B1TS":
        ends = torch.tensor([100, 2000, 2995, 3000], device="cuda")[:, None, None, None] - length
        mask = torch.arange(total, device="cuda") <= ends + torch.arange(length, device="cuda")[:, None]
    want = latent_attention_einsum(q, qr, lat, kr, mask, past if mask is None else 0, SCALE)
    half = [t.bfloat16() for t in (q, qr, lat, kr)]
    twin = latent_attention_einsum(*half, mask, past if mask is None else 0, SCALE).float()
    got = latent_attention_triton_eager(*half, mask, visible_before(past if mask is None else 0, length), SCALE)
    assert got.dtype == torch.bfloat16
    err, twin_err = ((x - want).norm() / want.norm() for x in (got.float(), twin))
    assert err < max(1e-2, 2 * twin_err), (err, twin_err)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("length", [1, 2])
def test_paged_kernel_equals_einsum_cuda_bf16(length):
    """`small`'s widths over a bf16 pool of 32-slot pages (the engine's), rows from 40 to 3000 slots, tables
    padded to 100 pages: against the fp32 twin, bounded by the bf16 twin's own distance."""
    config = ModelConfig.from_preset("debug", mla_num_heads=8, kv_lora_rank=256, qk_rope_head_dim=64)
    batch, width, size = 4, 100, 32
    pool = CachePool(config, num_slots=batch, num_pages=batch * width, page_size=size, device="cuda",
                     dtype=torch.float32)
    g = torch.Generator(device="cuda").manual_seed(16)
    pool.latent.normal_(generator=g)
    pool.k_rope.normal_(generator=g)
    table = 1 + torch.randperm(batch * width, device="cuda").view(batch, width)
    positions = torch.tensor([40, 1000, 2047, 3000], device="cuda") - length
    q, qr = (t.cuda() for t in _inputs(batch, 8, length, 256, 64, 1, seed=17)[:2])
    q = q / 16
    n = pool.mla_index[config.layer_types.index("mla")]
    fp32 = mla_decode.PagedLatents(pool.latent[n], pool.k_rope[n], table, positions)
    want = mla_decode.latent_attention_paged_einsum(q, qr, fp32, SCALE)
    half = mla_decode.PagedLatents(fp32.latent_NPR.bfloat16(), fp32.k_rope_NPE.bfloat16(), table, positions)
    twin = mla_decode.latent_attention_paged_einsum(q.bfloat16(), qr.bfloat16(), half, SCALE).float()
    got = mla_decode.latent_attention_paged_triton_eager(q.bfloat16(), qr.bfloat16(), *half, SCALE)
    assert got.dtype == torch.bfloat16
    err, twin_err = ((x - want).norm() / want.norm() for x in (got.float(), twin))
    assert err < max(1e-2, 2 * twin_err), (err, twin_err)


@interpreted
def test_engine_generates_the_same_tokens_with_the_kernel(monkeypatch):
    """The inference engine (chunked prefill, batched decode over the cache pool, rows at their own positions)
    with every absorbed MLA call on the kernel gives the tokens of a cache-free greedy loop, and the log
    probabilities of the same engine on the einsum twin (tokens alone let a wrong scale through)."""
    from k3.infer.engine import Engine, greedy_without_cache
    from k3.infer.sampling import SamplingParams
    from k3.model import K3ForCausalLM

    torch.manual_seed(0)
    # Two layers (KDA, then MLA): one MLA layer takes the same kernel calls as the preset's two, at half the launches.
    model = K3ForCausalLM(ModelConfig.from_preset("debug", num_layers=2, full_attn_layers=[2])).eval()
    prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=0)

    def engine_outputs():
        engine = Engine(model, None, max_context=128, max_batch=4, page_size=16, prefill_chunk=16)
        return [out.outputs[0] for out in engine.complete(prompts, params)]

    monkeypatch.setenv("K3_MLA_DECODE", "einsum")
    want = [greedy_without_cache(model, p, 8) for p in prompts]
    twin = engine_outputs()
    calls = _count_kernel_calls(monkeypatch)
    monkeypatch.setenv("K3_MLA_DECODE", "triton")
    got = engine_outputs()
    assert [out.token_ids for out in got] == [out.token_ids for out in twin] == want
    for out, ref in zip(got, twin):
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    assert any(shape[0] == 2 and shape[2] == 1 for shape in calls)  # batched one-token decode took the kernel
