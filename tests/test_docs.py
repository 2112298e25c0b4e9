"""The results page stays a page of results: BENCHMARKS.md is short, opens with its table, and names only
results files that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
TABLE_COLUMNS = ["what", "command", "k3", "baseline, same run", "device", "date", "results"]
MAX_LINES = 150


def table_cells(line: str) -> list[str]:
    """The cells of one markdown table row (`\\|` inside a cell is not a separator)."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", inner)]


def first_table(text: str) -> tuple[list[str], list[str]]:
    """The lines before the first table, and the first table's lines."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[:start], lines[start:end]


def test_benchmarks_is_under_150_lines() -> None:
    n = len(BENCHMARKS.read_text().splitlines())
    assert n < MAX_LINES, f"BENCHMARKS.md has {n} lines; keep it under {MAX_LINES} (write-ups go to docs/history/)"


def test_benchmarks_opens_with_the_results_table() -> None:
    before, table = first_table(BENCHMARKS.read_text())
    assert not [line for line in before if line.startswith("## ")], "the table must come before any section"
    assert len([line for line in before if line.strip()]) <= 6, "at most a title and a short paragraph before the table"
    assert table_cells(table[0]) == TABLE_COLUMNS
    assert set("".join(table_cells(table[1]))) <= set("-: ")
    assert len(table) > 2, "the table has no rows"
    for row in table[2:]:
        assert len(table_cells(row)) == len(TABLE_COLUMNS), f"row without {len(TABLE_COLUMNS)} cells: {row[:80]}"


def test_every_results_file_named_in_benchmarks_exists() -> None:
    # names with an extension: `--out bench/results/qb_balance` in a command is a prefix, not a file
    named = set(re.findall(r"bench/results/[\w.\-/]+\.\w+", BENCHMARKS.read_text()))
    assert named, "BENCHMARKS.md names no results file"
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"BENCHMARKS.md names results files that do not exist: {missing}"


README = ROOT / "README.md"
MAX_README_CELL = 120


def test_readme_opens_with_five_lines_then_the_two_commands() -> None:
    text = README.read_text()
    intro = text.split("```", 1)[0].splitlines()[1:]
    assert 0 < len([line for line in intro if line.strip()]) <= 5, "what k3 is, in five lines, before the commands"
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert len(blocks) >= 2 and blocks[0].endswith("k3 demo") and blocks[1].endswith("python -m pytest -q")


def test_ci_runs_the_readme_second_command_exactly() -> None:
    second = re.findall(r"```bash\n(.*?)\n```", README.read_text(), flags=re.S)[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert second in ci_lines, ".ci/run must run the README's second command as written"


def test_readme_table_cells_fit_one_line() -> None:
    long = [cell[:60] for line in README.read_text().splitlines() if line.startswith("|")
            for cell in table_cells(line) if len(cell) > MAX_README_CELL]
    assert not long, f"README table cells over {MAX_README_CELL} characters (move the detail to docs/): {long}"
