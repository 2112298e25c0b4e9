"""`k3 serve`: load a run or an HF-format model, start the engine, and serve it over HTTP until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3.cli_config import add_arguments, given
from k3.infer.cli import has_vision, load_multimodal, tokenizer_directory
from k3.infer.serve_config import ServeConfig


def _check_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the flags given (the rest at their defaults), checked."""
    return ServeConfig.flat(**given(ServeConfig, args))


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


def served_engine(run: str | None, model_path: str | None, device: str, dtype: str, options):
    """The served engine, built in the engine process (module level: the spawned child imports it); options: an
    EngineConfig."""
    from k3.infer.cli import build_engine, load_for_inference

    model, tokenizer = load_for_inference(run, model_path, device, dtype)
    return build_engine(model, tokenizer, options)


def serve_command(args: argparse.Namespace) -> int:
    config = _check_args(args)
    source, server, options = config.source, config.server, config.engine
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
    vision = source.model is not None and has_vision(Path(source.model))
    use_process = engine_process_default(source.device) if server.engine_process is None else server.engine_process
    if use_process and vision:
        print("k3 serve: a model with images runs its engine in the server's process (its vision tower encodes "
              "images there)", file=sys.stderr, flush=True)
        use_process = False
    name = source.served_model_name or Path(source.run or source.model).resolve().name
    if use_process:
        import functools

        from k3.checkpoint.inference import load_tokenizer_for_inference
        from k3.infer.engine_process import EngineProcess

        tokenizer = load_tokenizer_for_inference(source.run, source.model)

        def ready(seconds) -> None:
            print(f"k3 serve: warmed up in {seconds or 0:.1f} s (decode graphs, prefill shapes); /health is ready",
                  flush=True)

        aengine = EngineProcess(functools.partial(served_engine, source.run, source.model, source.device,
                                                  source.dtype, options),
                                max_queue=server.max_queue, warmup=server.warmup,
                                on_ready=ready if server.warmup else None)
        engine = aengine.engine
    else:
        if vision:
            model, tokenizer, images = load_multimodal(source.model, source.device)
        else:
            model, tokenizer = load_for_inference(source.run, source.model, source.device, source.dtype)
        engine = build_engine(model, tokenizer, options)

        def warm_up() -> None:
            print(f"k3 serve: warmed up in {engine.warmup():.1f} s (decode graphs, prefill shapes); /health is "
                  f"ready", flush=True)

        aengine = AsyncEngine(engine, max_queue=server.max_queue, warmup=warm_up if server.warmup else None,
                              freeze_gc=True)
    template = load_chat_template(tokenizer, tokenizer_directory(source.run, source.model))
    if source.chat_template:
        template = chosen_chat_template(source.chat_template, template)
    limits = ServerLimits(max_body_bytes=int(server.max_body_mb * 2**20), header_timeout_s=server.header_timeout,
                          keep_alive_s=server.keep_alive_timeout, max_connections=server.max_connections)
    hosts = tuple(server.allowed_hosts.split(",")) if server.allowed_hosts else default_allowed_hosts(server.host)
    origins = tuple(server.allowed_origins.split(",")) if server.allowed_origins else ()
    import os

    api_key = server.api_key or os.environ.get("K3_API_KEY") or None  # the environment is read here, at the edge
    app = create_app(aengine, name, tokenizer, options.max_context, server.max_queue, template, images, limits,
                     allowed_origins=origins, allowed_hosts=hosts, api_key=api_key, prepare_grammars=server.warmup)

    def listening(url: str) -> None:
        print(f"k3 serve: {name} on {url} (OpenAI-compatible: {url}/v1; device {engine.device}, max batch "
              f"{options.max_batch}, context {options.max_context}, engine "
              f"{'in its own process' if use_process else 'in process'}, chat format: {template.name} ({template.source})"
              f"{', API key required' if api_key else ''}"
              f"{', images: yes' if images is not None else ''}); Ctrl-C stops", flush=True)

    try:
        run_server(app, server.host, server.port, on_listening=listening, log_level=server.log_level,
                   exit_on_engine_death=not server.keep_serving_after_engine_error, limits=limits)
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
    add_arguments(serve, ServeConfig)  # every setting, from its field's docstring (k3.infer.serve_config)
    serve.set_defaults(func=serve_command)
