"""A debug model taught to call tools, for RL tests that need multi-turn episodes from the real engine."""

import json

import torch

from k3.rl.rollout import initial_messages
from k3.rl.tasks import task_from_dict


def say_tasks() -> list[dict]:
    return [{"id": f"say-{i}", "prompt": f"Say something about {word}.", "tools": ["python", "submit"],
             "verifier": {"type": "python", "function": "tests.rl.verifiers:answered_even_length"},
             "limits": {"turns": 3, "tokens_per_turn": 40, "total_tokens": 100}}
            for i, word in enumerate(["cats", "dogs"])]


def make_caller_run(tokenizer, root):
    """(run directory, suite file, model): a debug model fine-tuned (30 SFT steps) to answer with a python call,
    then submit. It makes multi-turn episodes, with enough spread between samples that groups get non-zero
    advantages."""
    from k3.config import ModelConfig
    from k3.model import K3ForCausalLM
    from k3.rl.sft import SFTConfig, SFTTrainer

    rows = []
    for data, code, answer in zip(say_tasks(), ["print(12+30)", "print(1+2)"], ["42", "3"]):
        rows.append({"messages": initial_messages(task_from_dict(data)) + [
            {"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
                                             % code},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": '<tool_call>{"name": "submit", "arguments": {"answer": "%s"}}'
                                             '</tool_call>' % answer}]})
    (root / "demos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    suite = root / "say.jsonl"
    suite.write_text("".join(json.dumps(t) + "\n" for t in say_tasks()))
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=tokenizer.vocab_size,
                                                  eos_token_id=tokenizer.eos_token_id))
    sft = SFTTrainer(SFTConfig(data=str(root / "demos.jsonl"), out=str(root / "sft"), steps=30, batch_size=2,
                               lr=1e-2, warmup_steps=2, device="cpu"), model=model, tokenizer=tokenizer,
                     show_progress=False)
    sft.train()
    return root / "sft", suite, sft.model.eval()
