"""The engine's CUDA paths against its PyTorch twin (runs only where CUDA is available)."""

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_graph_decode_equals_the_eager_step():
    """bf16 on one GPU: CUDA-graph decode and the eager step give the same greedy tokens, with logprobs within
    2e-2 (the graph replays the same kernels; differences come only from kernel choice at other shapes)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = K3ForCausalLM(ModelConfig.from_preset("tiny"))
    model = model.to(torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=generator).tolist()
               for n in (7, 33, 64, 100, 250)]
    params = SamplingParams(max_new_tokens=24, temperature=0, logprobs=0)
    eager = Engine(model, None, max_context=512, max_batch=8, use_cuda_graphs=False).complete(prompts, params)
    graph_engine = Engine(model, None, max_context=512, max_batch=8)
    graph = graph_engine.complete(prompts, params)
    assert graph_engine.runner.graphs, "no CUDA graph was captured"
    for a, b in zip(eager, graph):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 2e-2
