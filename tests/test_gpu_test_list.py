"""bench/gpu_tests.sh runs the CUDA tests on a GPU from a list of files: a test file that asks for CUDA but is
missing from that list would never run anywhere (CPU machines skip it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASKS_FOR_CUDA = re.compile(r"needs_cuda|torch\.cuda\.is_available\(\)|device=\"cuda\"")
# Files that name CUDA only to check what happens without it (their CUDA branch is a refusal or a skip reason).
CPU_ONLY = {"tests/conftest.py", "tests/test_runtime.py", "tests/test_gpu_test_list.py"}


def listed_files() -> set[str]:
    script = (ROOT / "bench" / "gpu_tests.sh").read_text()
    block = script.split("FILES=(", 1)[1].split(")", 1)[0]
    return {line.strip() for line in block.splitlines() if line.strip().startswith("tests/")}


def test_every_test_file_that_asks_for_cuda_is_in_the_gpu_runner_list():
    listed = listed_files()
    asking = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("*.py")
              if ASKS_FOR_CUDA.search(path.read_text())} - CPU_ONLY
    assert not asking - listed, f"add to bench/gpu_tests.sh's FILES: {sorted(asking - listed)}"
    assert all((ROOT / name).is_file() for name in listed), [n for n in listed if not (ROOT / n).is_file()]
