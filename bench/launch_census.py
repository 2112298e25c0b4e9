"""Where the training step's kernel launches come from: a census of one `small` training step, taken on the CPU.

It builds the model the CUDA step builds (`small`'s widths and layer kinds, bf16 parameters with fp32 masters,
the kernel switches as `auto` resolves them on CUDA, fla's kernels as their CPU stand-ins), runs one forward,
backward, gradient clip and optimizer step under a TorchDispatchMode, and records every aten op that would be a
CUDA launch of its own (views, metadata and allocations left out) with the k3 source line that issued it: the
innermost frame under k3/, or for an autograd backward op the forward line that made its node. k3's Triton
kernels (run in Triton's interpreter) and fla's entry points count one launch a call, in their own table.

The step is cut to run on a CPU: `--layers` (one AttnRes block of `small`: 3 KDA + 1 MLA) and short rows. Counts
are scaled to `small`'s 16 layers from a second run at twice the layers (count = c_L + (16 - L) / L * (c_2L - c_L)),
bytes (inputs + outputs of each op) to B x T = 4 x 4096 by a line fitted per source line through two row lengths.
What it predicts for the GPU (bytes / 3 TB/s + 3 us a launch) is an estimate, not a measurement.

    PYTHONPATH=$PWD python bench/launch_census.py            # the table, top 25 lines
    PYTHONPATH=$PWD python bench/launch_census.py --json     # every line, as JSON
    PYTHONPATH=$PWD python bench/launch_census.py --switch attn_res=torch   # another switch choice
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # k3's Triton kernels on CPU tensors: chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from _pytest.monkeypatch import MonkeyPatch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

K3_ROOT = str(Path(__file__).resolve().parents[1] / "k3") + os.sep
STANDINS = "fla_standins.py"
SMALL_LAYERS = 16
SMALL_TOKENS = 4 * 4096
HBM_BYTES_PER_S = 3.0e12
LAUNCH_S = 3e-6

# What `auto` picks for a bf16 training step on CUDA (k3/kernels.py), forced here since the tensors are on CPU.
CUDA_CHOICES = dict(kda="fla", conv="triton", rms_norm="triton", glu="triton", attn_res="triton", qb="triton",
                    moe="grouped", moe_combine="triton", adamw="triton", master_adamw="triton")

# Triton's interpreter takes seconds a launch at `small`'s widths, so only the kernels whose outputs pick indices
# (the expert order, QB's selection) run; the others' outputs stay unwritten, which changes no launch of the
# graphed step (it reads nothing back to the host).
RUN_BODIES = {"k3.ops.moe_permute_kernels", "k3.ops.qb_triton_kernels"}

# GEMMs and attention, listed apart from the small kernels.
GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_efficient_attention_backward"}

# Ops that launch nothing: views, metadata, allocations without a fill.
SILENT = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias",
          "_reshape_alias", "set_", "resize_", "_local_scalar_dense", "is_same_size", "_unsafe_view", "view",
          "_has_compatible_shallow_copy_type", "record_stream", "sym_size", "sym_stride", "sym_numel", "dim",
          "is_nonzero"}


@dataclass
class Line:
    """One source line's launches in a recorded step."""
    ops: collections.Counter = field(default_factory=collections.Counter)
    launches: int = 0
    bytes: int = 0


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def _k3_line_of_stack() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(K3_ROOT):
            return f"k3/{path[len(K3_ROOT):]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


def _k3_line_of_traceback(lines: list[str]) -> str | None:
    """The innermost k3 frame of a formatted forward traceback (autograd anomaly mode's node metadata)."""
    for entry in reversed(lines):
        head = entry.strip().splitlines()[0] if entry.strip() else ""
        if head.startswith("File ") and K3_ROOT in head:
            path, rest = head[len('File "'):].split('", line ', 1)
            number, _, name = rest.partition(", in ")
            return f"k3/{path[len(K3_ROOT):]}:{number} ({name.strip()})"
    return None


class Census(TorchDispatchMode):
    """Records launches per source line: aten ops here, Triton kernels and fla calls through record_custom."""

    def __init__(self):
        super().__init__()
        self.aten: dict[str, Line] = collections.defaultdict(Line)
        self.custom: dict[str, Line] = collections.defaultdict(Line)
        self.gemm: dict[str, Line] = collections.defaultdict(Line)
        self.quiet = 0  # > 0 inside a Triton kernel's interpreter run or an fla stand-in: their aten ops are theirs

    def where(self) -> str | None:
        found = _k3_line_of_stack()
        if found is not None:  # forward code, or the Python backward of a k3 autograd Function
            return found
        node = torch._C._current_autograd_node()  # a built-in backward: the line whose forward made the node
        trace = node.metadata.get("traceback_", []) if node is not None else []
        if any(STANDINS in entry for entry in trace):
            return None  # the backward of an fla stand-in: fla's backward kernels, counted at its forward
        forward = _k3_line_of_traceback(trace)
        return "backward of " + forward if forward is not None else "(outside k3)"

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.quiet or func.is_view or name in SILENT or func.namespace != "aten" or not _tensor_bytes(out):
            return out
        where = self.where()
        if where is None:
            return out
        line = (self.gemm if name in GEMMS else self.aten)[where]
        line.ops[name] += 1
        line.launches += 1
        line.bytes += _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
        return out

    @contextlib.contextmanager
    def custom_launch(self, name: str, args, kwargs):
        """One launch of a custom kernel (its own aten ops unseen)."""
        line = self.custom[self.where()]
        line.ops[name] += 1
        line.launches += 1
        line.bytes += _tensor_bytes(args) + _tensor_bytes(kwargs)
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1


def _kernel_function(launcher):
    fn = launcher
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


@contextlib.contextmanager
def _recording_kernels(census: Census):
    """Triton launches (outermost: an autotuner's run counts once) and fla stand-in calls as custom launches."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    depth = [0]

    def recorded(original):
        def wrapper(self, *args, **kwargs):
            if depth[0] or census.quiet:
                return original(self, *args, **kwargs)
            fn = _kernel_function(self)
            depth[0] += 1
            try:
                with census.custom_launch(f"triton:{fn.__name__}", args, kwargs):
                    if fn.__module__ in RUN_BODIES:
                        return original(self, *args, **kwargs)
                    return None  # the body left out: its outputs' values steer no launch of the step
            finally:
                depth[0] -= 1
        return wrapper

    patch = MonkeyPatch()
    patch.setattr(autotuner.Autotuner, "run", recorded(autotuner.Autotuner.run))
    patch.setattr(interpreter.GridExecutor, "__call__", recorded(interpreter.GridExecutor.__call__))
    try:
        yield
    finally:
        patch.undo()


@contextlib.contextmanager
def _fla_standins(census: Census):
    """fla's entry points as the tests' CPU stand-ins (tests/ops/fla_standins.py), each call one custom launch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))
    import fla_standins

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            with census.custom_launch(f"fla:{name}", args, kwargs):
                out = fn(*args, **kwargs)
            if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                               for a in (*args, *kwargs.values())):
                with census.custom_launch(f"fla:{name} backward", args, kwargs):
                    pass  # fla's backward entry point, one call a forward (its kernels are fla's)
            return out
        return wrapper

    saved = {module: dict(attrs) for module, attrs in fla_standins.MODULES.items()}
    for attrs in fla_standins.MODULES.values():
        for attr, fn in attrs.items():
            attrs[attr] = counted(attr, fn)
    patch = MonkeyPatch()
    try:
        with fla_standins.installed(patch, configured="auto"):
            yield
    finally:
        patch.undo()
        fla_standins.MODULES.update(saved)


def _batch(rows: int, row_length: int, vocab: int) -> dict[str, torch.Tensor]:
    """[rows, row_length] token rows of two documents each, cu_seqlens padded to the graphed step's static count."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, row_length), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    max_documents = max(16, row_length // 128) * rows
    starts = sorted({r * row_length + o for r in range(rows) for o in (0, row_length // 2)} | {rows * row_length})
    cu = torch.tensor(starts + [rows * row_length] * (max_documents + 1 - len(starts)), dtype=torch.int32)
    return dict(ids=ids, labels=labels, cu_seqlens=cu)


def census_of_step(layers: int, rows: int, row_length: int, switches: dict[str, str],
                   num_experts: int | None = None) -> Census:
    """The census of one training step of `small` cut to `layers` layers on [rows, row_length] tokens (and to
    num_experts experts, where given: the grouped expert GEMMs launch the same kernels for any count)."""
    from k3 import K3ForCausalLM, ModelConfig, kernels
    from k3.train.master_weights import MasterWeightAdamW

    config = ModelConfig.from_preset("small", num_layers=layers,
                                     full_attn_layers=[i for i in range(4, layers + 1, 4)],
                                     **({"num_experts": num_experts} if num_experts else {}))
    torch.manual_seed(0)
    census = Census()
    with kernels.use(**{**CUDA_CHOICES, **switches}), _fla_standins(census), _recording_kernels(census):
        model = K3ForCausalLM(config)
        model.train()
        optimizer = MasterWeightAdamW(model, 1e-4, 0.1)
        batch = _batch(rows, row_length, config.vocab_size)
        ids, labels = batch["ids"].reshape(1, -1), batch["labels"].reshape(1, -1)
        packing = dict(cu_seqlens=batch["cu_seqlens"], max_documents=batch["cu_seqlens"].shape[0] - 1,
                       row_length=row_length)
        def step():
            loss = model(ids, labels=labels, return_logits=False, **packing).loss
            loss.backward()
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            model.update_balancers()

        step()  # the first step also makes the optimizer's state: not a step the loop repeats
        census.aten.clear()
        census.custom.clear()
        census.gemm.clear()
        with torch.autograd.set_detect_anomaly(True, check_nan=False), census:
            step()
    return census


def scaled_table(short: Census, long: Census, deep: Census, layers: int, tokens: tuple[int, int]) -> list[dict]:
    """Per source line: launches scaled to `small`'s layers, bytes to 4 x 4096 tokens (module docstring)."""
    rows = []
    for kind in ("aten", "custom", "gemm"):
        a, b, c = getattr(short, kind), getattr(long, kind), getattr(deep, kind)
        for where in sorted(set(a) | set(b) | set(c)):
            base, more, twice = a.get(where, Line()), b.get(where, Line()), c.get(where, Line())
            launches = base.launches + (SMALL_LAYERS - layers) / layers * (twice.launches - base.launches)
            per_token = (more.bytes - base.bytes) / (tokens[1] - tokens[0])
            at_small_tokens = max(base.bytes + per_token * (SMALL_TOKENS - tokens[0]), 0.0)
            ratio = launches / base.launches if base.launches else (SMALL_LAYERS / layers)
            scale = (SMALL_LAYERS - layers) / layers
            ops = collections.Counter({op: round(base.ops[op] + scale * (twice.ops[op] - base.ops[op]))
                                       for op in set(base.ops) | set(twice.ops)})
            rows.append(dict(kind=kind, line=where, ops=dict(ops.most_common()), launches=round(launches),
                             bytes=at_small_tokens * ratio))
    rows.sort(key=lambda r: (-r["launches"], -r["bytes"]))
    return rows


def predicted_ms(rows: list[dict]) -> float:
    """Estimated GPU time of rows: bytes at 3 TB/s plus 3 us a launch (an estimate, not a measurement)."""
    return sum(r["bytes"] / HBM_BYTES_PER_S + r["launches"] * LAUNCH_S for r in rows) * 1e3


def print_table(rows: list[dict], top: int) -> None:
    for kind, title in (("aten", "PyTorch ops other than GEMMs (one CUDA launch each)"),
                        ("custom", "Triton kernels (k3's) and fla entry points"),
                        ("gemm", "GEMMs and attention (aten)")):
        chosen = [r for r in rows if r["kind"] == kind]
        total_l, total_b = sum(r["launches"] for r in chosen), sum(r["bytes"] for r in chosen)
        print(f"\n{title}: {total_l:,} launches, {total_b / 1e9:.2f} GB a `small` step "
              f"(estimate {predicted_ms(chosen):.1f} ms at 3 TB/s + 3 us a launch)")
        print(f"{'launches':>8} {'GB':>6}  source line  [ops]")
        for r in chosen[:top]:
            ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in list(r["ops"].items())[:5])
            print(f"{r['launches']:>8} {r['bytes'] / 1e9:>6.2f}  {r['line']}  [{ops}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="layers of the recorded step (a multiple of 4)")
    parser.add_argument("--rows", type=int, default=1, help="rows of the recorded step")
    parser.add_argument("--row-length", type=int, default=64, help="tokens a row (a multiple of 64); the byte fit "
                        "also runs at twice this")
    parser.add_argument("--switch", action="append", default=[], metavar="NAME=CHOICE",
                        help="a kernel switch over the CUDA choices (k3/kernels.py), e.g. attn_res=torch")
    parser.add_argument("--top", type=int, default=25, help="lines a table prints")
    parser.add_argument("--json", action="store_true", help="every line as JSON")
    parser.add_argument("--table-from", metavar="JSON", help="print the table of a census saved with --json")
    args = parser.parse_args(argv)
    if args.table_from:
        saved = json.loads(Path(args.table_from).read_text())
        print(f"census of one `small` training step (16 layers, 4 x 4096 tokens), switches {saved['switches']}")
        print_table(saved["lines"], args.top)
        return 0
    if args.layers < 4 or args.layers % 4:
        parser.error(f"--layers must be a positive multiple of 4 (one AttnRes block of `small`), got {args.layers}")
    if args.row_length < 64 or args.row_length % 64:
        parser.error(f"--row-length must be a positive multiple of 64 (KDA's chunk), got {args.row_length}")
    switches = {}
    for item in args.switch:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--switch takes NAME=CHOICE, got {item!r}")
        switches[name] = value
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    start = time.perf_counter()
    short = census_of_step(args.layers, args.rows, args.row_length, switches)
    long = census_of_step(args.layers, args.rows, 2 * args.row_length, switches)
    deep = census_of_step(2 * args.layers, args.rows, args.row_length, switches, num_experts=8)
    tokens = (args.rows * args.row_length, 2 * args.rows * args.row_length)
    rows = scaled_table(short, long, deep, args.layers, tokens)
    if args.json:
        json.dump(dict(layers=SMALL_LAYERS, tokens=SMALL_TOKENS, switches={**CUDA_CHOICES, **switches},
                       recorded=dict(layers=args.layers, rows=args.rows, row_length=args.row_length),
                       estimate_ms=dict(aten=predicted_ms([r for r in rows if r["kind"] == "aten"]),
                                        custom=predicted_ms([r for r in rows if r["kind"] == "custom"]),
                                        gemm=predicted_ms([r for r in rows if r["kind"] == "gemm"])),
                       lines=rows), sys.stdout, indent=1)
        print()
    else:
        print(f"census of one `small` training step (16 layers, 4 x 4096 tokens), scaled from steps of "
              f"{args.layers} and {2 * args.layers} layers on {args.rows} x {args.row_length} and "
              f"{args.rows} x {2 * args.row_length} tokens on the CPU ({time.perf_counter() - start:.0f} s)")
        print_table(rows, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
