"""`k3 serve`: load a run or an HF-format model, start the engine, and serve it over HTTP until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3.infer.cli import DTYPE_CHOICES, DTYPE_HELP, has_vision, load_multimodal, tokenizer_directory


def _default_max_connections() -> int:
    """1024, or fewer where the open-file limit is lower: connections past that limit fail in accept(), which
    the client sees as a hang, so the cap must come first. 100 files are left for the model, logs and sockets."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    return 1024 if soft == resource.RLIM_INFINITY else max(1, min(1024, soft - 100))


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0 = any free port), got {args.port}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_context < 2:
        raise ValueError(f"--max-context must be >= 2 (a prompt token and a new one), got {args.max_context}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    from k3.chat import BUILTIN

    template = getattr(args, "chat_template", None)
    if template and template not in BUILTIN and not Path(template).is_file():
        raise FileNotFoundError(f"--chat-template {template}: no such file, and not a built-in format "
                                f"({', '.join(BUILTIN)})")
    if not 0 < args.max_body_mb < 2**20:
        raise ValueError(f"--max-body-mb must be in (0, {2**20}), got {args.max_body_mb}")
    if args.max_connections is None:
        args.max_connections = _default_max_connections()
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    for flag in ("header_timeout", "keep_alive_timeout"):
        if not 0 < getattr(args, flag) < 86400:
            raise ValueError(f"--{flag.replace('_', '-')} must be in (0, 86400) seconds, got {getattr(args, flag)}")


def chosen_chat_template(choice: str, loaded):
    """--chat-template: a built-in format's name (kimi_k2, k3, plain) or a Jinja file, instead of the model's."""
    from k3.chat import BUILTIN, builtin_template
    from k3.infer.chat_template import ChatTemplate

    if choice in BUILTIN:
        return ChatTemplate(builtin_template(choice), f"built-in {choice}", loaded.bos_token, loaded.eos_token)
    path = Path(choice)
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {choice}: no such file, and not a built-in format "
                                f"({', '.join(BUILTIN)})")
    return ChatTemplate(path.read_text(encoding="utf-8"), str(path), loaded.bos_token, loaded.eos_token)


def engine_process_default(device: str) -> bool:
    """--engine-process when not given: on for CUDA (the step loop's host work then never waits for the
    server's), off on the CPU, where the engine's own threads need the cores the server would share (see
    docs/serve.md for the measurement)."""
    from k3.runtime import resolve_device

    return resolve_device(device).type == "cuda"


def served_engine(run: str | None, model_path: str | None, device: str, dtype: str, options: dict):
    """The served engine, built in the engine process (module level: the spawned child imports it)."""
    from k3.infer.cli import build_engine, load_for_inference

    model, tokenizer = load_for_inference(run, model_path, device, dtype)
    return build_engine(model, tokenizer, **options)


def serve_command(args: argparse.Namespace) -> int:
    _check_args(args)
    try:
        from k3.infer.server import create_app, run_server
    except ImportError as error:
        raise RuntimeError(f"k3 serve needs FastAPI and uvicorn ({error}); install them with "
                           f"pip install 'k3[serve]'") from error
    from k3.infer.async_engine import AsyncEngine
    from k3.infer.connection_limits import ServerLimits
    from k3.infer.origins import default_allowed_hosts
    from k3.infer.chat_template import load_chat_template
    from k3.infer.cli import build_engine, load_for_inference

    images = None
    vision = args.model is not None and has_vision(Path(args.model))
    use_process = engine_process_default(args.device) if args.engine_process is None else args.engine_process
    if use_process and vision:
        print("k3 serve: a model with images runs its engine in the server's process (its vision tower encodes "
              "images there)", file=sys.stderr, flush=True)
        use_process = False
    name = args.served_model_name or Path(args.run or args.model).resolve().name
    engine_options = dict(max_context=args.max_context, max_batch=args.max_batch,
                          prefix_cache=not args.no_prefix_cache)
    if use_process:
        import functools

        from k3.checkpoint.inference import load_tokenizer_for_inference
        from k3.infer.engine_process import EngineProcess

        tokenizer = load_tokenizer_for_inference(args.run, args.model)

        def ready(seconds) -> None:
            print(f"k3 serve: warmed up in {seconds or 0:.1f} s (decode graphs, prefill shapes); /health is ready",
                  flush=True)

        aengine = EngineProcess(functools.partial(served_engine, args.run, args.model, args.device, args.dtype,
                                                  engine_options),
                                max_queue=args.max_queue, warmup=not args.no_warmup,
                                on_ready=None if args.no_warmup else ready)
        engine = aengine.engine
    else:
        if vision:
            model, tokenizer, images = load_multimodal(args.model, args.device)
        else:
            model, tokenizer = load_for_inference(args.run, args.model, args.device, args.dtype)
        engine = build_engine(model, tokenizer, **engine_options)

        def warm_up() -> None:
            print(f"k3 serve: warmed up in {engine.warmup():.1f} s (decode graphs, prefill shapes); /health is "
                  f"ready", flush=True)

        aengine = AsyncEngine(engine, max_queue=args.max_queue, warmup=None if args.no_warmup else warm_up)
    template = load_chat_template(tokenizer, tokenizer_directory(args.run, args.model))
    if args.chat_template:
        template = chosen_chat_template(args.chat_template, template)
    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * 2**20), header_timeout_s=args.header_timeout,
                          keep_alive_s=args.keep_alive_timeout, max_connections=args.max_connections)
    hosts = tuple(args.allowed_hosts.split(",")) if args.allowed_hosts else default_allowed_hosts(args.host)
    origins = tuple(args.allowed_origins.split(",")) if args.allowed_origins else ()
    import os

    api_key = args.api_key or os.environ.get("K3_API_KEY") or None  # the environment is read here, at the edge
    app = create_app(aengine, name, tokenizer, args.max_context, args.max_queue, template, images, limits,
                     allowed_origins=origins, allowed_hosts=hosts, api_key=api_key)

    def listening(url: str) -> None:
        print(f"k3 serve: {name} on {url} (OpenAI-compatible: {url}/v1; device {engine.device}, max batch "
              f"{args.max_batch}, context {args.max_context}, engine "
              f"{'in its own process' if use_process else 'in process'}, chat format: {template.name} ({template.source})"
              f"{', API key required' if api_key else ''}"
              f"{', images: yes' if images is not None else ''}); Ctrl-C stops", flush=True)

    try:
        run_server(app, args.host, args.port, on_listening=listening, log_level=args.log_level,
                   exit_on_engine_death=not args.keep_serving_after_engine_error, limits=limits)
    finally:
        aengine.shutdown()
    print("k3 serve: stopped", file=sys.stderr, flush=True)
    return 0


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="serve a trained run or an HF model over an OpenAI-compatible HTTP API",
        description="POST /v1/completions and /v1/chat/completions (streaming, n, logprobs, stop, seed), "
                    "GET /v1/models, /health and /metrics (Prometheus). Continuous batching over the hybrid "
                    "cache; see docs/serve.md.")
    source = serve.add_argument_group("model")
    source.add_argument("--run", help="a `k3 train` run directory (or its checkpoint.pt or sharded checkpoint/)")
    source.add_argument("--model", help="a Hugging Face-format model directory")
    source.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    source.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    source.add_argument("--chat-template", help="the chat format instead of the model's own: a built-in name "
                                                "(kimi_k2, k3, plain) or a Jinja chat template file")
    source.add_argument("--served-model-name", help="the model name clients send (default: the directory's name)")
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine "
                                                           "only; 0.0.0.0 = every interface)")
    http.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    http.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes (default: the "
                                        "K3_API_KEY environment variable; none = open)")
    http.add_argument("--allowed-origins", help="comma-separated web origins (e.g. http://localhost:3000) whose "
                      "pages may call the server, with CORS headers; '*' = any. By default a request that carries "
                      "an Origin header (any browser page) is refused with 403")
    http.add_argument("--allowed-hosts", help="comma-separated Host header values accepted (default: localhost, "
                      "127.0.0.1 and ::1 when listening on loopback, any otherwise); others get 400")
    http.add_argument("--max-body-mb", type=float, default=32.0,
                      help="largest request body in MiB; larger ones get HTTP 413 before they are read (default 32)")
    http.add_argument("--max-connections", type=int, default=None,
                      help="most open connections; past it new ones get HTTP 503 and are closed (default 1024, or "
                           "fewer when the process may open fewer files: its open-file limit less 100)")
    http.add_argument("--header-timeout", type=float, default=10.0,
                      help="seconds a connection may take to send a request's headers before it is closed "
                           "(default 10)")
    http.add_argument("--keep-alive-timeout", type=float, default=5.0,
                      help="seconds an idle connection is kept open between requests (default 5)")
    http.add_argument("--keep-serving-after-engine-error", action="store_true",
                      help="if the engine loop stops, keep answering (/health 503, requests 503) instead of "
                           "exiting with status 1 for a supervisor to restart")
    http.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                      help="uvicorn's log level (default warning)")
    engine = serve.add_argument_group("engine")
    engine.add_argument("--max-batch", type=int, default=32, help="most sequences decoding at once (default 32)")
    engine.add_argument("--max-context", type=int, default=4096,
                        help="longest prompt + generation per sequence, in tokens (default 4096)")
    engine.add_argument("--max-queue", type=int, default=256,
                        help="most requests waiting for a slot; beyond it requests get HTTP 429 (default 256)")
    engine.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    engine.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine in a process of its own, so the server's Python work (tokenizing, "
                             "JSON, streaming) never holds up its steps (default: on for CUDA, off on the CPU; "
                             "models with images always run in process)")
    engine.add_argument("--no-warmup", action="store_true",
                        help="skip the warm-up (decode graphs for every batch size, prefill shapes) that runs "
                             "before /health reports ready (503 'warming up' until then); the first requests then "
                             "pay for it")
    serve.set_defaults(func=serve_command)
