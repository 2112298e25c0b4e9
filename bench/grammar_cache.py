"""Time to first token of `tool_choice: "required"` chat requests through `k3 serve`'s app (real HTTP, the
official client, streaming), one at a time with the same tools: request 1 compiles the tool-call grammar,
later ones reuse it from k3.infer.structured's cache. Also times the grammar preparation alone (plan + one
matcher per sequence) per request. CPU, a random-init `debug` model, a BPE of --vocab ids trained on the repo's
own text (so the grammar is compiled against a vocabulary of realistic size).

Usage: PYTHONPATH=. python bench/grammar_cache.py [--vocab 32768] [--requests 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "a tool", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer",
                                     "minimum": 1, "maximum": 14}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "days"]}}} for i in range(4)]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "infer"))
    import openai
    import torch
    from inprocess_server import InProcessServer

    from k3.chat import ChatFormat, attach_chat_format, builtin_template
    from k3.config import ModelConfig
    from k3.data.tokenizer import train_bpe
    from k3.infer.chat_request import plan_chat
    from k3.infer.protocol import ChatCompletionRequest
    from k3.infer.structured import GrammarTokenizer
    from k3.model import K3ForCausalLM

    corpus = [p for p in sorted(ROOT.glob("k3/**/*.py")) + sorted(ROOT.glob("tests/**/*.py"))
              if p.name not in ("structured.py", "test_structured.py")]  # the same text before and after this cache
    texts = [p.read_text(errors="ignore") for p in corpus]
    tokenizer = train_bpe(texts, vocab_size=args.vocab, show_progress=False)
    fmt = ChatFormat(builtin_template("kimi_k2"))
    attach_chat_format(tokenizer, fmt)

    grammars = GrammarTokenizer(tokenizer, tokenizer.vocab_size)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, "tools": TOOLS,
                                                 "tool_choice": "required"})
    import llguidance.torch as llt

    prepare, first_mask = [], []
    for _ in range(args.requests):
        start = time.perf_counter()
        matcher = plan_chat(body, fmt, tokenizer, lambda: grammars).grammar.matcher()
        prepare.append(time.perf_counter() - start)
        bitmask = llt.allocate_token_bitmask(1, tokenizer.vocab_size)
        start = time.perf_counter()
        matcher.fill(bitmask, 0)
        first_mask.append(time.perf_counter() - start)

    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)).eval()
    server = InProcessServer(model, tokenizer, max_context=1024)
    ttft = []
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            for i in range(args.requests):
                start = time.perf_counter()
                stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4,
                                                        tool_choice="required", stream=True, seed=i)
                first = None
                for _ in stream:
                    first = first if first is not None else time.perf_counter() - start
                ttft.append(first)
    finally:
        server.stop()
    result = {"vocab": tokenizer.vocab_size, "prepare_first_ms": 1e3 * prepare[0],
              "prepare_later_p50_ms": 1e3 * statistics.median(prepare[1:]),
              "first_mask_first_ms": 1e3 * first_mask[0],
              "first_mask_later_p50_ms": 1e3 * statistics.median(first_mask[1:]),
              "ttft_first_ms": 1e3 * ttft[0], "ttft_later_p50_ms": 1e3 * statistics.median(ttft[1:])}
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}"
                                                           for k, v in result.items()))


if __name__ == "__main__":
    main()
