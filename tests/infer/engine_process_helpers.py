"""Builders for tests of the engine in its own process (k3.infer.engine_process): module-level, so the spawned
child can import them, and deterministic, so the test's tokenizer equals the child's."""

from __future__ import annotations

KIMI_MARKERS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
                "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


def kimi_tokenizer():
    """A small BPE with Kimi's markers as special tokens, in the kimi_k2 chat format."""
    from k3.chat import ChatFormat, attach_chat_format, builtin_template
    from k3.data.tokenizer import BPETokenizer, train_bpe

    text = ('<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|tool_calls_section_begin|>'
            '{"city": "Paris", "days": 3} hello world')
    tokenizer = train_bpe([text] * 8, vocab_size=330, show_progress=False)
    tokenizer.backend.add_special_tokens(KIMI_MARKERS)
    tokenizer = BPETokenizer(tokenizer.backend)
    attach_chat_format(tokenizer, ChatFormat(builtin_template("kimi_k2"), "built-in kimi_k2",
                                             eos_token="<|endoftext|>"))
    return tokenizer


def tiny_engine(max_context: int = 512, max_batch: int = 8):
    import torch

    from k3.config import ModelConfig
    from k3.infer.engine import Engine
    from k3.model import K3ForCausalLM

    torch.set_num_threads(1)
    tokenizer = kimi_tokenizer()
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size)).eval()
    return Engine(model, tokenizer, max_context=max_context, max_batch=max_batch, prefix_cache=False)


def failing_build():
    raise RuntimeError("no model here")
