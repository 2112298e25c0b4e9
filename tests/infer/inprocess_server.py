"""`k3 serve`'s app on a free loopback port in a thread of the test process (uvicorn, the real HTTP path), so
a test can reach the engine under it (a logits processor that forces a reply). Always stopped."""

from __future__ import annotations

import threading
import time


class InProcessServer:
    def __init__(self, model, tokenizer, chat_template=None, max_context: int = 256, max_batch: int = 8,
                 api_key: str | None = None, start_timeout_s: float = 30.0, warmup=None,
                 prepare_grammars: bool = False) -> None:
        import uvicorn

        from k3.infer.async_engine import AsyncEngine
        from k3.infer.engine import Engine
        from k3.infer.server import create_app

        self.engine = Engine(model, tokenizer, max_context=max_context, max_batch=max_batch, prefix_cache=False)
        self.aengine = AsyncEngine(self.engine, max_queue=64, warmup=warmup)
        kwargs = {"api_key": api_key} if api_key is not None else {}
        self.app = create_app(self.aengine, "tiny", tokenizer, max_context, 64, chat_template,
                              prepare_grammars=prepare_grammars, **kwargs)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the HTTP server, then the engine (a warm-up still running finishes first: shutdown waits)."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.aengine.shutdown()


class ForceReply:
    """A logits processor that makes every row write `ids` (then anything): row r's next token is
    ids[len(generated)] while the script lasts. Set .ids = None to let the model choose."""

    def __init__(self) -> None:
        self.ids: list[int] | None = None

    def __call__(self, rows, logits):
        if self.ids is None:
            return logits
        logits = logits.clone()
        for row, seq in enumerate(rows):
            position = len(seq.generated)
            if position < len(self.ids):
                logits[row] = float("-inf")
                logits[row, self.ids[position]] = 0.0
        return logits
