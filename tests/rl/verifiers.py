"""A verifier that crashes, for tests of how a crash ends only its episode."""


def crash_on_ok(answer, sandbox, task):
    return 1 / 0 if answer == "ok" else 0.0


def even_length(answer, sandbox, task):
    """Reward that differs between samples of one group, so every RL step has an update to make."""
    return float(answer is not None and len(answer) % 2 == 0)
