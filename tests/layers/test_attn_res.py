import torch

from k3.layers.attn_res import AttnResMix, AttnResStream


def test_zero_pseudo_query_gives_uniform_mean():
    mix = AttnResMix(32)
    sources = [torch.randn(2, 5, 32) * (i + 1) for i in range(4)]
    torch.testing.assert_close(mix(sources), torch.stack(sources).mean(0))


def test_mix_matches_formula():
    mix = AttnResMix(8)
    torch.nn.init.normal_(mix.proj.weight)
    torch.nn.init.normal_(mix.norm.weight)
    sources = [torch.randn(3, 8, dtype=torch.float64) for _ in range(3)]
    query = mix.norm.weight.double() * mix.proj.weight.double()[0]
    scores = torch.stack([(v @ query) / v.pow(2).mean(-1).add(mix.norm.eps).sqrt() for v in sources])
    expected = (scores.softmax(0).unsqueeze(-1) * torch.stack(sources)).sum(0)
    torch.testing.assert_close(mix(sources), expected)


def test_single_source_passes_through_unchanged():
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    assert AttnResMix(16)([x]) is x


def test_stream_blocks():
    emb = torch.zeros(1)
    stream = AttnResStream(emb, block_size=2)
    outputs = []
    for layer in range(5):
        stream.start_layer(layer)
        for _ in range(2):  # attention and MLP outputs
            out = torch.tensor([float(len(outputs) + 1)])
            outputs.append(out)
            stream.add(out)
    # b_0 = embedding, b_1 = layers 0-1 (outputs 1..4), b_2 = layers 2-3 (5..8), partial = layer 4 (9, 10)
    values = [float(s) for s in stream.sources()]
    assert values == [0.0, 1 + 2 + 3 + 4, 5 + 6 + 7 + 8, 9 + 10]
