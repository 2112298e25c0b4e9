"""`k3 serve` that prints, as each of its threads starts, whether torch.compile's modules and the grammar library
were imported by then: python -m threads_serve serve --run DIR ... (lines "thread NAME compiler=B grammar=B")."""

import sys
import threading

from k3.cli import main

_start = threading.Thread.start


def _start_and_tell(self):
    print(f"thread {self.name} compiler={'torch._dynamo' in sys.modules} "
          f"grammar={'llguidance.torch' in sys.modules}", flush=True)
    _start(self)


if __name__ == "__main__":
    threading.Thread.start = _start_and_tell
    sys.exit(main(sys.argv[1:]))
