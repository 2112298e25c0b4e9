"""ServeConfig: what `k3 serve` runs (the model, the HTTP server, the engine); each field's docstring is its --help
text (k3.cli_config builds the flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from k3.cli_config import from_flat, option, section
from k3.infer.engine_config import EngineConfig
from k3.runtime import DTYPE_CHOICES, DTYPE_HELP

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def default_max_connections() -> int:
    """1024, or fewer where the open-file limit is lower: connections past that limit fail in accept(), which
    the client sees as a hang, so the cap must come first. 100 files are left for the model, logs and sockets."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    return 1024 if soft == resource.RLIM_INFINITY else max(1, min(1024, soft - 100))


@dataclass
class ModelSource:
    """model"""

    run: str | None = None
    """a `k3 train` run directory (or its checkpoint.pt or sharded checkpoint/)"""
    model: str | None = None
    """a Hugging Face-format model directory"""
    device: str = "auto"
    """cpu, cuda, cuda:N (default: cuda if available)"""
    dtype: str = field(default="auto", metadata=option(choices=DTYPE_CHOICES, help=DTYPE_HELP))
    chat_template: str | None = None
    """the chat format instead of the model's own: a built-in name (kimi_k2, k3, plain) or a Jinja chat template
    file"""
    served_model_name: str | None = None
    """the model name clients send (default: the directory's name)"""

    def __post_init__(self) -> None:
        from k3.chat import BUILTIN

        if self.chat_template and self.chat_template not in BUILTIN and not Path(self.chat_template).is_file():
            raise FileNotFoundError(f"--chat-template {self.chat_template}: no such file, and not a built-in format "
                                    f"({', '.join(BUILTIN)})")


@dataclass
class ServerConfig:
    """server"""

    host: str = "127.0.0.1"
    """address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 = every interface)"""
    port: int = 8000
    """port (default 8000; 0 = any free port)"""
    api_key: str | None = None
    """require 'Authorization: Bearer KEY' on /v1/ routes (default: the K3_API_KEY environment variable; none =
    open)"""
    allowed_origins: str | None = None
    """comma-separated web origins (e.g. http://localhost:3000) whose pages may call the server, with CORS headers;
    '*' = any. By default a request that carries an Origin header (any browser page) is refused with 403"""
    allowed_hosts: str | None = None
    """comma-separated Host header values accepted (default: localhost, 127.0.0.1 and ::1 when listening on
    loopback, any otherwise); others get 400"""
    max_body_mb: float = 32.0
    """largest request body in MiB; larger ones get HTTP 413 before they are read (default 32)"""
    max_connections: int | None = None
    """most open connections; past it new ones get HTTP 503 and are closed (default 1024, or fewer when the process
    may open fewer files: its open-file limit less 100)"""
    header_timeout: float = 10.0
    """seconds a connection may take to send a request's headers before it is closed (default 10)"""
    keep_alive_timeout: float = 5.0
    """seconds an idle connection is kept open between requests (default 5)"""
    keep_serving_after_engine_error: bool = False
    """if the engine loop stops, keep answering (/health 503, requests 503) instead of exiting with status 1 for a
    supervisor to restart"""
    log_level: str = field(default="warning", metadata=option(choices=LOG_LEVELS))
    """uvicorn's log level (default warning)"""
    max_queue: int = 256
    """most requests waiting for a slot; beyond it requests get HTTP 429 (default 256)"""
    warmup: bool = field(default=True, metadata=option(negative_help=(
        "skip the warm-up (decode graphs for every batch size, prefill shapes) that runs before /health reports "
        "ready (503 'warming up' until then); the first requests then pay for it")))
    """warm up the engine before /health reports ready"""
    engine_process: bool | None = None
    """run the engine in a process of its own, so the server's Python work (tokenizing, JSON, streaming) never holds
    up its steps (default: on for CUDA, off on the CPU; models with images always run in process)"""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535] (0 = any free port), got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 < self.max_body_mb < 2**20:
            raise ValueError(f"--max-body-mb must be in (0, {2**20}), got {self.max_body_mb}")
        if self.max_connections is None:
            self.max_connections = default_max_connections()
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout", "keep_alive_timeout"):
            if not 0 < getattr(self, name) < 86400:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 86400) seconds, got "
                                 f"{getattr(self, name)}")


@dataclass
class ServeConfig:
    """`k3 serve`: a model served over an OpenAI-compatible HTTP API."""

    source: ModelSource = section(ModelSource)
    server: ServerConfig = section(ServerConfig)
    engine: EngineConfig = section(EngineConfig, title="engine")

    @classmethod
    def flat(cls, **fields) -> ServeConfig:
        """Built from flat names, as the flags call the fields: ServeConfig.flat(port=0, max_batch=4)."""
        return from_flat(cls, fields)
