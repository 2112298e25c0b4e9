"""`k3 generate` and `k3 chat` (a later `k3 serve` registers here too)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from k3.checkpoint.inference import load_for_inference
from k3.cli_config import add_arguments, from_flat, given, section
from k3.infer.engine import Engine
from k3.infer.engine_config import EngineConfig
from k3.infer.sampling import SamplingParams
from k3.infer.serve_config import ModelSource
from k3.runtime import resolve_device



@dataclass
class InferenceSettings:
    """`k3 serve`'s model and engine flags that generate and chat take too (from the fields, as serve's)."""

    source: ModelSource = section(ModelSource)
    engine: EngineConfig = section(EngineConfig, title="engine")


# Flags a command leaves out: generate runs without a prefix cache, chat keeps one conversation.
SKIP = {"generate": ("chat_template", "served_model_name", "prefix_cache"),
        "chat": ("chat_template", "served_model_name", "max_batch")}


def has_vision(directory: Path) -> bool:
    """An HF directory whose config.json carries a vision tower (a multimodal K3 checkpoint)."""
    import json

    config_file = directory / "config.json"
    if not config_file.is_file():
        return False
    return "vision_config" in json.loads(config_file.read_text())


def load_multimodal(path: str, device: str):
    """(the language model for the engine, tokenizer, ImageInputs) from a multimodal K3 directory."""
    from k3.checkpoint.hf import load_hf_tokenizer
    from k3.infer.image_inputs import ImageInputs
    from k3.checkpoint.hf_multimodal import from_pretrained
    target = resolve_device(device)
    model = from_pretrained(path, progress=False).to(target).eval()
    tokenizer = load_hf_tokenizer(path, required=False)
    if tokenizer is None:
        raise FileNotFoundError(f"{path} holds no tokenizer files (tokenizer.json or tiktoken.model); serving "
                                f"needs one")
    return model.language_model, tokenizer, ImageInputs(model)


def build_engine(model, tokenizer, config: EngineConfig | None = None, **options) -> Engine:
    """Engine(model, tokenizer, config, **options), with an allocation that fails (sizes too large for the device)
    reported against the flags that set them."""
    config = dataclasses.replace(config or EngineConfig(), **options)
    try:
        return Engine(model, tokenizer, config)
    except (RuntimeError, MemoryError, OverflowError) as error:
        raise RuntimeError(f"the engine's caches for --max-context {config.max_context} and --max-batch "
                           f"{config.max_batch} could not be allocated ({type(error).__name__}: "
                           f"{str(error).splitlines()[0][:200]}); lower --max-context or --max-batch") from error


def _settings(args: argparse.Namespace, **engine_defaults) -> tuple[ModelSource, EngineConfig]:
    """The model source and engine settings of the flags given; engine_defaults: the command's own values for the
    engine fields its flags leave out."""
    settings = from_flat(InferenceSettings, {**engine_defaults, **given(InferenceSettings, args)})
    return settings.source, settings.engine


def _sampling(args: argparse.Namespace, tokenizer) -> SamplingParams:
    stop_ids = []
    for text in args.stop_token or []:
        ids = tokenizer.encode(text)
        if len(ids) != 1:
            raise ValueError(f"--stop-token {text!r} is {len(ids)} tokens for this tokenizer; give text that is "
                             f"exactly one token")
        stop_ids.append(ids[0])
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, stop_token_ids=stop_ids, seed=args.seed)


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts-file {path} does not exist")
        prompts.extend(line for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    if not prompts:
        raise ValueError("no prompt given; use --prompt TEXT (repeatable) or --prompts-file FILE (one per line)")
    return [p.encode("utf-8").decode("unicode_escape") if args.escapes else p for p in prompts]


class _Streamer:
    """Prints one sequence's text as its tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, stops: set[int], out=None) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.out = out or sys.stdout  # looked up now, not at import: callers may have redirected stdout
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        if token in self.stops:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)


def _generate_with_images(args: argparse.Namespace) -> int:
    """One prompt after the given images, on a multimodal K3 directory (--model)."""
    source, options = _settings(args, max_batch=1, prefix_cache=False)
    if source.model is None or not has_vision(Path(source.model)):
        raise ValueError("--image needs --model with a multimodal K3 directory (a config.json with vision_config)")
    for image in args.image:
        if not Path(image).is_file():
            raise FileNotFoundError(f"--image {image} does not exist")
    model, tokenizer, images = load_multimodal(source.model, source.device)
    params = _sampling(args, tokenizer)
    prompts = _prompts(args)
    if len(prompts) != 1:
        raise ValueError(f"--image takes exactly one --prompt (the text after the images), got {len(prompts)}")
    marker = "\x00k3-image\x00"
    ids, embeds = images.prompt(marker * len(args.image) + prompts[0], marker, list(args.image), tokenizer,
                                local_files=True)
    engine = build_engine(model, tokenizer, options)
    engine.check_prompt(ids, params, name="the prompt (with the images' tokens)")
    out = engine.complete([ids], params, prompt_embeds=[embeds])[0].outputs[0]
    print(f"{prompts[0]}{out.text}")
    return 0


def generate_command(args: argparse.Namespace) -> int:
    if args.image:
        return _generate_with_images(args)
    prompts = _prompts(args)
    source, options = _settings(args, prefix_cache=False)
    options = dataclasses.replace(options, max_batch=min(len(prompts), options.max_batch))  # no idle slots
    model, tokenizer = load_for_inference(source.run, source.model, source.device, source.dtype)
    params = _sampling(args, tokenizer)
    engine = build_engine(model, tokenizer, options)
    if args.chat:  # each prompt is one user message, in the model's chat format
        fmt = chat_format_for(args, tokenizer)
        params = _chat_params(args, tokenizer, fmt)
        ids = [fmt.encode([{"role": "user", "content": p}], tokenizer) for p in prompts]
        prompts = [tokenizer.decode(i) for i in ids]
    else:
        ids = [tokenizer.encode(p) for p in prompts]
    # Validate every prompt before printing anything (a long prompt would otherwise be echoed, then refused).
    for i, prompt_ids in enumerate(ids):
        engine.check_prompt(prompt_ids, params, name=f"prompt {i}" if len(ids) > 1 else "the prompt")
    if len(prompts) == 1 and not args.no_stream:
        streamer = _Streamer(tokenizer, engine.stop_ids(params))
        sys.stdout.write(prompts[0])
        engine.generate_ids(ids, params, on_token=lambda _, token: streamer(token))
        sys.stdout.write("\n")
        return 0
    outputs = engine.complete(ids, params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        print(f"=== [{i}] ===\n{prompt}{out.outputs[0].text}")
    return 0


def tokenizer_directory(run: str | None, model_path: str | None) -> Path | None:
    """Where a chat template file may sit: the HF model directory, or the run's tokenizer/ directory."""
    if model_path is not None:
        return Path(model_path)
    from k3.checkpoint.run import SHARDED_CHECKPOINT_NAME

    path = Path(run)
    run_dir = path.parent if path.is_file() or path.name == SHARDED_CHECKPOINT_NAME else path
    return run_dir / "tokenizer"


def chat_format_for(args: argparse.Namespace, tokenizer):
    """The model's chat format (k3.chat): its tokenizer's template, else the plain "User:/Assistant:" lines."""
    from k3.infer.chat_template import load_chat_template

    return load_chat_template(tokenizer, tokenizer_directory(args.run, args.model))


def _chat_params(args: argparse.Namespace, tokenizer, fmt) -> SamplingParams:
    params = _sampling(args, tokenizer)
    stop_ids, stop_strings = fmt.stops(tokenizer)
    params.stop_token_ids += stop_ids
    params.stop = stop_strings
    return params


def chat_command(args: argparse.Namespace) -> int:
    """A conversation on the terminal in the model's chat format (k3.chat; a model trained on plain text talks
    in "User: ..." / "Assistant:" lines and its reply stops at a newline). Each turn sends the whole
    conversation, built message by message as in training; the engine's prefix cache starts it from the
    previous turn's saved state, so little is recomputed."""
    source, options = _settings(args, max_batch=1)
    if options.prefix_cache:  # a few states of earlier turns, so each turn starts from the last one
        options = dataclasses.replace(options, prefix_slots=4)
    model, tokenizer = load_for_inference(source.run, source.model, source.device, source.dtype)
    engine = build_engine(model, tokenizer, options)
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # bytes that are not UTF-8 (a binary file piped in) become U+FFFD
    fmt = chat_format_for(args, tokenizer)
    params = _chat_params(args, tokenizer, fmt)
    print(f"k3 chat ({fmt.name} format): type a message, empty line or Ctrl-D to quit", file=sys.stderr)
    messages: list[dict] = []
    turn = 0
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        conversation = fmt.encode(messages, tokenizer)
        if params.seed is not None:
            params.seed = args.seed + turn
        params.max_new_tokens = min(args.max_new_tokens, engine.max_context - len(conversation))
        if params.max_new_tokens < 1:
            raise ValueError(f"the conversation has reached {len(conversation)} tokens and the context allows "
                             f"{engine.max_context}; start a new chat or raise --max-context")
        engine.check_prompt(conversation, params, name="the conversation")
        streamer = _Streamer(tokenizer, engine.stop_ids(params))
        reply = engine.generate_ids([conversation], params, on_token=lambda _, token: streamer(token))[0]
        messages.append({"role": "assistant", "content": engine.text_of(reply, params)})
        turn += 1
        if not tokenizer.decode(streamer.ids).endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def _add_common(parser: argparse.ArgumentParser, command: str) -> None:
    add_arguments(parser, InferenceSettings, skip=SKIP[command])
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=64)
    sampling.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    sampling.add_argument("--top-k", type=int, default=0, help="0 = off")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    sampling.add_argument("--stop-token", action="append", help="extra stop token (text of one token); repeatable")
    sampling.add_argument("--seed", type=int, default=None)


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate text from a trained run or an HF model",
                                description="Prefill each prompt into the hybrid cache, then decode with it.")
    _add_common(gen, "generate")
    gen.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--escapes", action="store_true", help="interpret backslash escapes (\\n, \\t) in prompts")
    gen.add_argument("--no-stream", action="store_true", help="print a single prompt's output only at the end")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message through the model's "
                                                         "chat format (its tokenizer's chat template)")
    gen.add_argument("--image", action="append", help="an image file the prompt follows (multimodal --model "
                                                      "directories only); repeatable")
    gen.set_defaults(func=generate_command)

    chat = subparsers.add_parser("chat", help="talk to a trained run or an HF model on the terminal",
                                 description="A chat loop in the model's chat format; the cache keeps the "
                                             "conversation.")
    _add_common(chat, "chat")
    chat.set_defaults(func=chat_command)
