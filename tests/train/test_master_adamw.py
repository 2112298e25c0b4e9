"""The fused master-weight AdamW step (k3.ops.master_adamw, K3_MASTER_ADAMW=triton) against its PyTorch twin
(master_adamw_step_torch: equal, every tensor, every step) and against the torch path it replaces (fp32 gradient
copies clipped, torch's AdamW on the masters: within fp32 roundings); the clip's fp32 norm; state and checkpoint
layout; exact resume through the trainer. Without a GPU the kernel runs in Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1)."""

import copy
import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from k3 import kernels  # noqa: E402
from k3.checkpoint.native import load_checkpoint  # noqa: E402
from k3.ops import master_adamw  # noqa: E402
from k3.train.master_weights import MasterWeightAdamW  # noqa: E402
from k3.train.metrics import read_metrics  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
LRS = (1e-2, 5e-3, 2e-2, 1e-3)  # a schedule that changes at every step
CLIP = 0.5  # below the gradients' norm at most steps, so the clip coefficient is applied


def net() -> nn.Module:
    """Tensors of a partial block, of whole blocks (2048 and 4096 elements) and of a whole block plus a tail,
    matrices (decayed) and vectors (not), an embedding (not decayed)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 128), nn.LayerNorm(128), nn.Linear(128, 32),
                         nn.Linear(32, 71)).to(DEVICE)


def grads_for(model: nn.Module, step: int) -> None:
    """Random bf16 gradients, large enough that CLIP bites; the LayerNorm's weight has none at step 1."""
    g = torch.Generator().manual_seed(100 + step)
    for name, p in model.named_parameters():
        p.grad = None if (step == 1 and name == "2.weight") else (
            torch.randn(p.shape, generator=g) * (3.0 if step % 2 else 0.05)).to(DEVICE, torch.bfloat16)


def run(optimizer: MasterWeightAdamW, model: nn.Module, steps: int = 4) -> list[float]:
    norms = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = LRS[step % len(LRS)]
        grads_for(model, step)
        norms.append(float(optimizer.clip_grad_norm_(CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def states(optimizer: MasterWeightAdamW) -> dict[str, list[torch.Tensor]]:
    state = [optimizer.inner.state[m] for m in optimizer.masters]
    return {"param": [p.detach() for p in optimizer.params], "master": [m.detach() for m in optimizer.masters],
            "exp_avg": [s["exp_avg"] for s in state], "exp_avg_sq": [s["exp_avg_sq"] for s in state],
            "step": [s["step"] for s in state]}


def test_the_kernel_equals_its_twin_over_steps(monkeypatch):
    """Weight decay on and off (two groups), a new lr every step, the clip applied first, a parameter without a
    gradient skipped (its master, moments and count untouched at that step)."""
    fused_model = net()
    fused = MasterWeightAdamW(fused_model, lr=LRS[0], weight_decay=0.1, fused=True)
    twin_model = copy.deepcopy(net())
    twin = MasterWeightAdamW(twin_model, lr=LRS[0], weight_decay=0.1, fused=True)
    fused_norms = run(fused, fused_model)
    assert fused.fused_stepped == len(fused.params)  # every tensor through the kernel at the last step
    monkeypatch.setattr(master_adamw, "fused_available", lambda device: False)  # everything to the twin
    twin_norms = run(twin, twin_model)
    assert twin.fused_stepped == 0
    assert fused_norms == twin_norms
    have, want = states(fused), states(twin)
    for key in have:
        for i, (a, b) in enumerate(zip(have[key], want[key])):
            assert torch.equal(a, b), (key, i, float((a.double() - b.double()).abs().max()))
    layer_norm = fused.names.index("2.weight")
    assert float(have["step"][layer_norm]) == 3 and float(have["step"][0]) == 4


def test_the_fused_step_matches_the_torch_path():
    """The same run through the copies and torch's AdamW: the same fp32 norms, masters and moments within a few
    fp32 roundings of the values, parameters the masters rounded, the same state layout."""
    fused_model, torch_model = net(), copy.deepcopy(net())
    fused = MasterWeightAdamW(fused_model, lr=LRS[0], weight_decay=0.1, fused=True)
    reference = MasterWeightAdamW(torch_model, lr=LRS[0], weight_decay=0.1, fused=False)
    fused_norms, reference_norms = run(fused, fused_model), run(reference, torch_model)
    assert fused_norms == pytest.approx(reference_norms, rel=1e-6)
    have, want = states(fused), states(reference)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for a, b in zip(have[key], want[key]):
            scale = b.abs().max().clamp_min(1e-3)
            assert float((a - b).abs().max()) <= 1e-5 * float(scale), key
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(have["param"], have["master"]))
    assert all(torch.equal(a, b) for a, b in zip(have["step"], want["step"]))
    a, b = fused.state_dict(), reference.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        other = b["state"][index]
        assert {k: (v.dtype, v.shape, v.device) for k, v in entry.items()} == \
            {k: (v.dtype, v.shape, v.device) for k, v in other.items()}


def test_the_clip_sees_the_fp32_norm_of_the_bf16_gradients():
    model = net()
    optimizer = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, fused=True)
    grads_for(model, 0)
    want = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
    got = optimizer.clip_grad_norm_(CLIP)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(want), rel=1e-6)
    assert float(optimizer.grad_scale) == pytest.approx(CLIP / float(want), rel=1e-5)
    # bf16 norms would be off by up to 2^-9 of the value: the fp32 one is far closer
    assert abs(float(got) - float(want)) < 1e-4 * float(want)


def test_take_grads_still_hands_over_fp32_gradients_for_a_caller_to_clip():
    model = net()
    optimizer = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, fused=True)
    grads_for(model, 0)
    masters = optimizer.take_grads()
    assert all(m.grad.dtype == torch.float32 and torch.equal(m.grad, p.grad.float())
               for m, p in zip(masters, model.parameters()))
    before = [m.detach().clone() for m in masters]
    optimizer.step()
    assert all(not torch.equal(m, b) for m, b in zip(masters, before))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), masters))


def test_odd_tensors_go_to_the_twin_and_bad_options_are_refused():
    model = net()
    optimizer = MasterWeightAdamW(model, lr=1e-2, weight_decay=0.1, fused=True)
    grads_for(model, 0)
    first = next(model.parameters())
    first.grad = first.grad.t().contiguous().t()  # [50, 16] with transposed strides: not contiguous
    optimizer.step()
    assert optimizer.fused_stepped == len(optimizer.params) - 1
    optimizer.param_groups[0]["amsgrad"] = True
    grads_for(model, 2)
    with pytest.raises(ValueError, match="amsgrad"):
        optimizer.step()


def test_the_switch_picks_the_step(monkeypatch):
    monkeypatch.delenv("K3_MASTER_ADAMW", raising=False)
    with kernels.use(master_adamw="torch"):
        assert not MasterWeightAdamW(net(), lr=1e-2, weight_decay=0.1).fused
    with kernels.use(master_adamw="triton"):
        assert MasterWeightAdamW(net(), lr=1e-2, weight_decay=0.1).fused
    with kernels.use(master_adamw="auto"):
        assert MasterWeightAdamW(net(), lr=1e-2, weight_decay=0.1).fused == (DEVICE == "cuda")


def test_a_resumed_fused_run_continues_exactly(tmp_path):
    """Masters and optimizer state saved as the trainer saves them (model_state_dict: the fp32 masters under the
    parameters' names; state_dict: the inner AdamW's), loaded into a new model and optimizer: the next steps are
    those of the unbroken run, bit for bit."""
    model = net()
    unbroken = MasterWeightAdamW(model, lr=LRS[0], weight_decay=0.1, fused=True)
    run(unbroken, model, steps=4)

    first_model = net()
    first = MasterWeightAdamW(first_model, lr=LRS[0], weight_decay=0.1, fused=True)
    run(first, first_model, steps=2)
    path = tmp_path / "state.pt"
    torch.save({"model": first.model_state_dict(first_model), "optimizer": first.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    assert saved["model"].keys() == dict(first_model.named_parameters()).keys()
    assert all(v.dtype == torch.float32 for v in saved["model"].values())

    second_model = net()
    second_model.load_state_dict(saved["model"])
    second = MasterWeightAdamW(second_model, lr=LRS[0], weight_decay=0.1, fused=True)
    second.load_masters(second_model, saved["model"])
    second.load_state_dict(saved["optimizer"])
    for step in (2, 3):  # the unbroken run's last two steps
        for group in second.param_groups:
            group["lr"] = LRS[step % len(LRS)]
        grads_for(second_model, step)
        second.clip_grad_norm_(CLIP)
        second.step()
        second.zero_grad()
    have, want = states(second), states(unbroken)
    for key in have:
        assert all(torch.equal(a, b) for a, b in zip(have[key], want[key])), key


@pytest.mark.slow  # about two minutes: the debug model's 106 tensors in Triton's CPU interpreter, 18 steps
def test_fused_training_resumes_exactly_and_reads_the_torch_paths_checkpoints(tmp_path, corpus_dir, small_config):
    """On the CPU, where a step is deterministic. The checkpoint holds the fp32 masters under the parameters'
    names, as the torch path writes it; a run broken at step 4 by the torch path and resumed by the fused one
    continues as one fused run resumed from its own checkpoint."""
    def config(out, **changes):
        return small_config(out, corpus_dir, master_weights="bf16-params", device="cpu", max_steps=6, eval_every=6,
                            **changes)

    with kernels.use(master_adamw="triton"):
        unbroken = Trainer(config(tmp_path / "unbroken"), show_progress=False)
        assert unbroken.optimizer.fused
        unbroken.train()
        Trainer(config(tmp_path / "broken"), show_progress=False).train(stop_at=4)
        Trainer(config(tmp_path / "broken"), resume=True, show_progress=False).train()
    with kernels.use(master_adamw="torch"):
        Trainer(config(tmp_path / "mixed"), show_progress=False).train(stop_at=4)
    with kernels.use(master_adamw="triton"):
        Trainer(config(tmp_path / "mixed"), resume=True, show_progress=False).train()
    steps = lambda run: [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run / "metrics.jsonl")
                         if "loss" in r]
    assert steps(tmp_path / "broken") == steps(tmp_path / "unbroken") and len(steps(tmp_path / "unbroken")) == 6
    a, b = load_checkpoint(tmp_path / "unbroken"), load_checkpoint(tmp_path / "broken")
    assert a["model"].keys() == {name for name, _ in unbroken.model.state_dict().items()}
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(v.dtype == torch.float32 for k, v in a["model"].items() if k.endswith(".weight"))
    for name, p in unbroken.model.named_parameters():
        assert torch.equal(p, a["model"][name].to(torch.bfloat16))
    # The torch path's first four steps differ from the kernel's by fp32 roundings only.
    mixed = steps(tmp_path / "mixed")
    assert [s for s, _, _ in mixed] == [s for s, _, _ in steps(tmp_path / "unbroken")]
    assert [loss for _, loss, _ in mixed] == pytest.approx([loss for _, loss, _ in steps(tmp_path / "unbroken")],
                                                           rel=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernel_equals_its_twin_at_a_million_elements(monkeypatch):
    """The GPU's kernel (no FMA contraction, IEEE square roots and divisions) bit for bit against the twin's
    torch ops on the GPU, at sizes of `small`'s projections."""
    shapes = [(1024, 1024), (4096, 257), (3,)]

    def tensors(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        masters = [torch.randn(s, device="cuda", generator=g) * 0.02 for s in shapes]
        return ([m.to(torch.bfloat16) for m in masters],
                [(torch.randn(s, device="cuda", generator=g) * 1e-3).to(torch.bfloat16) for s in shapes],
                masters, [torch.zeros(s, device="cuda") for s in shapes],
                [torch.zeros(s, device="cuda") for s in shapes],
                [torch.zeros((), device="cuda") for _ in shapes])

    kernel, twin = tensors(0), tensors(0)
    scale = torch.tensor(0.8, device="cuda")
    tables = master_adamw.MultiTensorTables()
    for lr in LRS[:3]:
        for lists in (kernel, twin):
            torch._foreach_add_(lists[5], 1)
        assert master_adamw.master_adamw_step(*kernel, lr, 0.9, 0.95, 1e-8, 0.1, grad_scale=scale,
                                              tables=tables) == len(shapes)
        master_adamw.master_adamw_step_torch(*twin, lr, 0.9, 0.95, 1e-8, 0.1, grad_scale=scale)
    for a_list, b_list in zip(kernel, twin):
        assert all(torch.equal(a, b) for a, b in zip(a_list, b_list))


_COMPILE_FOR_HOPPER = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3.ops.master_adamw_kernels import master_adamw_step
signature = {"table_ptr": "*i64", "blocks_ptr": "*i32", "scale_ptr": "*fp32", "param_base": "*bf16",
             "master_base": "*fp32", **{name: "fp64" for name in ("lr", "beta1", "beta2", "eps", "weight_decay")},
             **{name: "constexpr" for name in ("HAS_SCALE", "DECAY", "MAXIMIZE", "BLOCK")}}
aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # as a launch specializes torch's tensors
source = ASTSource(master_adamw_step, signature, attrs=aligned,
                   constexprs={"HAS_SCALE": True, "DECAY": True, "MAXIMIZE": False, "BLOCK": 2048})
try:
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
except RuntimeError as exc:
    if "backend" in str(exc).lower() or "ptxas" in str(exc).lower():
        raise SystemExit(f"SKIP no CUDA compiler in this Triton: {exc}")
    raise
print(sorted(set(re.findall(r"(?:sqrt|div|fma|ld[.]global|st[.]global)[.][a-z0-9.]+", ptx))))
"""


@pytest.mark.slow  # a compile in a fresh process: about 15 s on two busy cores
def test_kernel_compiles_for_hopper_with_wide_accesses(tmp_path):
    """sm_90 PTX without a GPU (the interpreter runs what the compiler refuses): 16-byte loads and stores through
    the table's offsets, IEEE square roots and divisions, and no fused multiply-adds (the twin rounds every
    operation)."""
    import ast
    import subprocess
    import sys

    if DEVICE == "cuda":
        pytest.skip("on a GPU the tests above run the compiled kernel")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0 and "SKIP" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]
    found = set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    assert {"sqrt.rn.f32", "div.rn.f32", "ld.global.v4.b32", "st.global.v4.b32"} <= found, found
    assert not any(op.startswith(("fma", "sqrt.approx", "div.full", "div.approx")) for op in found), found
