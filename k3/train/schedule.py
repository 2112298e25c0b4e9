"""The length curriculum: sequence length by step, as K3 trains at 8K and then at 64K.

    "256:0,1024:2000"  ->  [[256, 0], [1024, 2000]]: 256-token rows, then 1024-token rows once 2000 steps are done

A step's stage is the last one whose start step is <= the number of steps already done. Tokens per step stay
those of the first stage (batch_size rows of its length): a stage of length n packs batch_size * first / n
rows (at least one). Every stage reads its own deterministic stream (seed, stage), so where a run is in the
data is (stage, rows consumed), and a resume on either side of a stage change continues exactly.
"""

from __future__ import annotations


def parse_seq_len_schedule(text: str) -> list[list[int]]:
    """"256:0,1024:2000" -> [[256, 0], [1024, 2000]] (validated by check_seq_len_schedule)."""
    stages = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            length, start = part.split(":")
            stages.append([int(length), int(start)])
        except ValueError:
            raise ValueError(f"cannot read stage {part!r} of --seq-len-schedule; write LENGTH:START_STEP pairs "
                             f"like 256:0,1024:2000") from None
    check_seq_len_schedule(stages)
    return stages


def check_seq_len_schedule(stages: list[list[int]]) -> None:
    if not stages:
        raise ValueError("the sequence-length schedule is empty; write LENGTH:START_STEP pairs like 256:0,1024:2000")
    if stages[0][1] != 0:
        raise ValueError(f"the first stage must start at step 0, got {stages[0][0]}:{stages[0][1]}")
    for (_, before), (length, start) in zip(stages, stages[1:]):
        if start <= before:
            raise ValueError(f"stage start steps must increase; {length}:{start} follows a stage from step {before}")
    for length, _ in stages:
        if length < 2:
            raise ValueError(f"stage length must be at least 2 tokens, got {length}")


def stage_at(stages: list[list[int]], steps_done: int) -> int:
    """Index of the stage that the next step (after `steps_done` steps) trains in."""
    index = 0
    for i, (_, start) in enumerate(stages):
        if start <= steps_done:
            index = i
    return index


def rows_for(stages: list[list[int]], index: int, batch_size: int) -> int:
    """Rows per step in stage `index`: the first stage's tokens per step at this stage's length."""
    return max(1, batch_size * stages[0][0] // stages[index][0])
