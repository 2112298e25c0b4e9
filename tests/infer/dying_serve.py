"""`k3 serve` whose engine steps all fail, for the tests of an engine that dies:
python -m dying_serve serve --run DIR ... (the first request's step fails and stops the engine loop)."""

import sys

from k3.cli import main
from k3.infer import async_engine
from k3.infer.engine import Engine


def _broken_step(self):
    raise RuntimeError("injected engine failure")


if __name__ == "__main__":
    async_engine.MAX_FAILED_STEPS = 1
    Engine.step = _broken_step
    # No warm-up (its steps would fail before the first request), unless the test is about the warm-up failing.
    args = sys.argv[1:]
    sys.exit(main([a for a in args if a != "--warm-up-dies"] if "--warm-up-dies" in args else [*args, "--no-warmup"]))
