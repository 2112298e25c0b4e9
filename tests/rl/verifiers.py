"""A verifier that crashes, for tests of how a crash ends only its episode."""


def crash_on_ok(answer, sandbox, task):
    return 1 / 0 if answer == "ok" else 0.0


def even_length(answer, sandbox, task):
    """Reward that differs between samples of one group, so every RL step has an update to make."""
    return float(answer is not None and len(answer) % 2 == 0)


def answered_even_length(answer, sandbox, task):
    """Half the reward for any answer, all of it for an even-length one: a group's rewards differ whenever some of
    its samples answer and others run out of turns, which a tiny model's sloppy calls do often."""
    if answer is None:
        return 0.0
    return 1.0 if len(answer) % 2 == 0 else 0.5
