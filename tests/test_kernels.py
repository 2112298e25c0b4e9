"""The kernel registry (k3/kernels.py): every switch declared once and read only there, choices checked, use()
and reference() scoped, `k3 info --kernels`, and docs/gpu.md's table generated from it."""

import io
import json
import re
import threading
import tokenize
from pathlib import Path

import pytest

from k3 import kernels
from k3.ops.attn_res import attn_res_backend, set_attn_res_backend
from k3.ops.fused_backend import fused_backend, set_fused_backend
from k3.ops.kda import kda_backend, set_kda_backend

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "k3"

# Read outside the registry on purpose: torchrun's variables and the sandbox's paths (k3/sandbox/ is left out
# below); command-line modules may read settings too, the edge where they enter (e.g. `k3 serve`'s key).
ENVIRON_READERS = {
    "k3/kernels.py": "the registry",
    "k3/distributed/launch.py": "torchrun's WORLD_SIZE / LOCAL_RANK / RANK / MASTER_*",
    "k3/rl/data_parallel.py": "torchrun's WORLD_SIZE",
    "k3/rl/fleet.py": "forwards the sandbox paths to fleet workers",
}
SANDBOX_VARIABLES = {"K3_SANDBOX_HOME", "K3_SANDBOX_SCRATCH"}  # k3/sandbox/paths.py's, forwarded by rl/fleet.py


def _is_cli(relative: str) -> bool:
    stem = Path(relative).stem
    return stem in ("cli", "__main__") or stem.endswith("_cli")


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith("k3/sandbox/"):
            yield relative, path.read_text()


def _k3_names(text: str) -> tuple[set[str], set[str]]:
    """(K3_ names in a module's strings and comments, where variables are named; its K3_ Python identifiers)."""
    mentioned, identifiers = set(), set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME:
            identifiers.update(re.findall(r"^K3_[A-Z0-9_]+$", token.string))
        elif token.type != tokenize.OP:
            mentioned.update(re.findall(r"\bK3_[A-Z0-9_]+\b", token.string))
    return mentioned, identifiers


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for switch in kernels.SWITCHES.values():
        monkeypatch.delenv(switch.env, raising=False)


def test_every_k3_variable_named_in_the_package_is_declared_in_the_registry():
    declared = {s.env for s in kernels.SWITCHES.values()} | set(kernels.OTHER_VARIABLES) | SANDBOX_VARIABLES
    edge = set()  # settings a command-line module reads from the environment (not kernel switches)
    identifiers = set()  # Python constants called K3_..., named again inside f-strings
    named = {}
    for relative, text in _sources():
        if _is_cli(relative):
            edge.update(re.findall(r"environ[^\n]*?\b(K3_[A-Z0-9_]+)\b", text))
        mentioned, constants = _k3_names(text)
        identifiers |= constants
        for name in mentioned:
            named.setdefault(name, relative)
    undeclared = {name: where for name, where in named.items() if name not in declared | edge | identifiers}
    assert not undeclared, f"K3_ variables named outside k3/kernels.py's registry: {undeclared}"
    assert {"K3_MOE_BACKEND", "K3_ATTN_RES_ACCUMULATE", "K3_AUTOTUNE_CONFIGS"} <= set(named)  # the scan sees them
    assert len(kernels.SWITCHES) == 27 and len({s.env for s in kernels.SWITCHES.values()}) == 27


def test_only_the_registry_torchrun_sandbox_paths_and_the_cli_read_the_environment():
    readers = {relative for relative, text in _sources() if re.search(r"os\.environ|os\.getenv|getenv\(", text)}
    outside = sorted(reader for reader in readers - set(ENVIRON_READERS) if not _is_cli(reader))
    assert not outside, f"os.environ read in {outside}: read kernel switches through k3.kernels"
    assert "k3/kernels.py" in readers


def test_each_switch_has_a_default_among_its_choices_and_a_twin_called_torch():
    for switch in kernels.SWITCHES.values():
        assert switch.default in switch.choices, switch.name
        if switch.choices != ("0", "1"):
            assert switch.reference in ("torch", None), switch.name
            assert all(target == "torch" for target in switch.aliases.values()), switch.name
        assert switch.reason and "\n" not in switch.reason and len(switch.reason) <= 110, switch.name


def test_reasons_link_to_sections_that_exist_in_benchmarks_md():
    def slug(title: str) -> str:
        return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")

    anchors = {slug(line.lstrip("#")) for line in (ROOT / "docs/history/benchmarks.md").read_text().splitlines()
               if line.startswith("#")}
    missing = {s.name: s.see for s in kernels.SWITCHES.values() if s.see not in anchors}
    assert not missing, f"update `see` in k3/kernels.py: docs/history/benchmarks.md has no such section: {missing}"


def test_environment_is_read_at_call_time_with_old_names_as_aliases(monkeypatch):
    assert kernels.choice("moe") == "auto" and kernels.source("moe") == "default"
    monkeypatch.setenv("K3_MOE_BACKEND", "loop")
    assert kernels.choice("moe") == "torch" and kernels.source("moe") == "K3_MOE_BACKEND"
    for env, old in (("K3_ATTN_RES_BACKEND", "eager"), ("K3_MLA_DECODE", "einsum"), ("K3_MOE_COMBINE", "bmm"),
                     ("K3_LINEAR_CE", "plain"), ("K3_ROUTER_LOGITS", "fp32"), ("K3_GLU_BACKEND", "formula")):
        monkeypatch.setenv(env, f" {old.upper()} ")
        assert kernels.choice(env) == "torch", env
    monkeypatch.setenv("K3_COMPILE_DECODE", "true")
    assert kernels.enabled("compile_decode")
    monkeypatch.setenv("K3_KDA_RECURRENT_LAUNCH", "16,2,2")
    assert kernels.choice("kda_launch") == "16,2,2"


def test_a_bad_environment_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("K3_MOE_BACKEND", "cutlass")
    with pytest.raises(ValueError, match=r"K3_MOE_BACKEND='cutlass'; use auto, torch, grouped or triton "
                                         r"\(kernel switch 'moe' in k3/kernels.py; loop also means torch\)"):
        kernels.choice("moe")


def test_use_checks_its_choices_and_names():
    with pytest.raises(ValueError, match=r"glu='fast'; use auto, torch, compiled or triton"):
        with kernels.use(glu="fast"):
            pass
    with pytest.raises(ValueError, match="unknown kernel switch 'gluu'; the switches are kda, "):
        with kernels.use(gluu="torch"):
            pass
    with pytest.raises(ValueError, match="name the kernel switch 'moe', not its variable 'K3_MOE_BACKEND'"):
        kernels.checked({"K3_MOE_BACKEND": "torch"})
    assert kernels.choice("glu") == "auto"


def test_use_overrides_environment_and_pins_and_restores_on_exit(monkeypatch):
    monkeypatch.setenv("K3_MOE_BACKEND", "grouped")
    set_kda_backend("torch")
    try:
        with kernels.use(moe="triton", kda="auto", compile_decode=True):
            assert kernels.choice("moe") == "triton" and kda_backend() == "auto"
            assert kernels.enabled("compile_decode") and kernels.source("moe") == "use"
            with kernels.use(moe="loop"):
                assert kernels.choice("moe") == "torch"
            assert kernels.choice("moe") == "triton"
        assert kernels.choice("moe") == "grouped" and kda_backend() == "torch"
        assert kernels.source("kda") == "pin"
        with pytest.raises(RuntimeError, match="inside"):
            with kernels.use(moe="torch"):
                raise RuntimeError("inside")
        assert kernels.choice("moe") == "grouped"
    finally:
        set_kda_backend(None)
    assert kda_backend() == "auto"


def test_reference_selects_every_twin_and_then_restores():
    with kernels.reference():
        chosen = {s.name: kernels.choice(s.name) for s in kernels.SWITCHES.values()}
        assert fused_backend() == "torch" and attn_res_backend() == "torch"
    assert chosen["kda_launch"] == "auto" and chosen["kda_chunk"] == "64"  # tuning knobs, no twin: left as they are
    assert {name: value for name, value in chosen.items() if kernels.SWITCHES[name].reference is not None} == {
        s.name: s.reference for s in kernels.SWITCHES.values() if s.reference is not None}
    assert chosen["join_projections"] == chosen["attn_res_accumulate"] == chosen["compile_decode"] == "0"
    assert all(kernels.source(name) == "default" for name in kernels.SWITCHES)


def test_old_setters_pin_through_the_registry():
    set_fused_backend("torch")
    set_attn_res_backend("eager")
    try:
        assert kernels.choice("fused") == fused_backend() == "torch"
        assert attn_res_backend() == "torch"
        with pytest.raises(ValueError, match="fused \\(pinned\\)='cuda'; use auto, torch or fla"):
            set_fused_backend("cuda")
    finally:
        set_fused_backend(None)
        set_attn_res_backend(None)
    assert kernels.source("fused") == kernels.source("attn_res") == "default"


def test_use_blocks_of_two_threads_closing_out_of_order_leave_nothing_behind():
    entered, release_first = threading.Event(), threading.Event()
    seen = {}

    def first():
        with kernels.use(moe="triton"):
            entered.set()
            assert release_first.wait(10)
            seen["first"] = kernels.choice("moe")

    thread = threading.Thread(target=first)
    thread.start()
    assert entered.wait(10)
    block = kernels.use(moe="grouped")
    block.__enter__()
    release_first.set()
    thread.join(10)
    assert not thread.is_alive()
    assert seen["first"] == "grouped"  # process-wide, like the environment: the innermost block wins
    assert kernels.choice("moe") == "grouped"
    block.__exit__(None, None, None)
    assert kernels.choice("moe") == "auto"


def test_docs_gpu_md_holds_the_generated_table():
    text = (ROOT / "docs" / "gpu.md").read_text()
    start = text.index("do not edit by hand -->\n") + len("do not edit by hand -->\n")
    end = text.index("<!-- end of kernel switches -->")
    assert text[start:end] == kernels.markdown_table(), \
        "docs/gpu.md's switch table is stale: paste the output of `k3 info --markdown` between its markers"


def test_k3_info_kernels_prints_the_resolved_table_as_text_and_json(monkeypatch, capsys):
    from k3.cli import main

    monkeypatch.setenv("K3_MOE_BACKEND", "loop")
    assert main(["info", "--kernels", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(kernels.SWITCHES)
    assert rows["moe"]["choice"] == "torch" and rows["moe"]["source"] == "K3_MOE_BACKEND"
    assert rows["glu"]["choice"] == "auto" and rows["glu"]["source"] == "default"
    assert main(["info", "--kernels"]) == 0
    assert re.search(r"^moe +K3_MOE_BACKEND +torch +of auto, torch, grouped, triton +\(from K3_MOE_BACKEND\)$",
                     capsys.readouterr().out, re.MULTILINE)
    monkeypatch.setenv("K3_MOE_BACKEND", "bad")
    assert main(["info", "--kernels"]) == 1
    assert "K3_MOE_BACKEND='bad'; use auto, torch, grouped or triton" in capsys.readouterr().err


def test_rms_norm_torch_takes_the_twin_where_triton_would_run():
    import torch

    from k3.ops.norm import k3_triton_path

    x, weight = torch.randn(4, 8), torch.ones(8)
    with kernels.use(rms_norm="triton"):  # CPU tensors reach k3's kernels only in Triton's interpreter
        assert k3_triton_path(x, weight) == ("forced" if kernels.triton_interpreting() else None)
    with kernels.use(rms_norm="torch"):
        assert k3_triton_path(x, weight) is None
