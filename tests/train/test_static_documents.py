"""The static-shape form of packed documents (what the captured CUDA training step runs: cu_seqlens padded by
zero-length documents to a fixed count, full attention masked within rows, no host sync) equals the packed
step that loops over documents: loss and every gradient, on CPU."""

import pytest
import torch

from k3 import K3ForCausalLM, ModelConfig
from k3.model import pad_cu_seqlens

ROWS, LENGTH = 2, 48
# documents inside each row (rows start documents too): lengths 20 + 28 | 5 + 1 + 30 + 12
CU = torch.tensor([0, 20, 48, 53, 54, 84, 96])


def losses_and_grads(model, ids, **packing):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, return_logits=False, **packing).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("balancing", ["quantile", "loss_free"])
def test_static_documents_equal_the_per_document_packed_step(balancing):
    config = ModelConfig.from_preset("debug", moe_balancing=balancing)
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()  # the bias frozen: both forwards route alike
    ids = torch.randint(1, config.vocab_size, (1, ROWS * LENGTH), generator=torch.Generator().manual_seed(1))
    want, want_grads = losses_and_grads(model, ids, cu_seqlens=CU)
    padded = pad_cu_seqlens(CU, 10)
    assert padded.tolist() == CU.tolist() + [96] * 4
    got, got_grads = losses_and_grads(model, ids, cu_seqlens=padded, max_documents=10, row_length=LENGTH)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_static_documents_differ_from_rows_without_documents():
    # The check above would pass vacuously if documents were ignored: here they are not.
    config = ModelConfig.from_preset("debug")
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    ids = torch.randint(1, config.vocab_size, (1, ROWS * LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rows = model(ids.view(ROWS, LENGTH), labels=ids.view(ROWS, LENGTH), return_logits=False).loss
        static = model(ids, labels=ids, return_logits=False, cu_seqlens=pad_cu_seqlens(CU, 10), max_documents=10,
                       row_length=LENGTH).loss
    assert abs(float(rows) - float(static)) > 1e-4


def test_padding_refuses_too_many_documents_and_wrong_shapes():
    with pytest.raises(ValueError, match="exceed max_documents=4"):
        pad_cu_seqlens(CU, 4)
    config = ModelConfig.from_preset("debug")
    model = K3ForCausalLM(config)
    ids = torch.ones(1, ROWS * LENGTH, dtype=torch.long)
    with pytest.raises(ValueError, match="max_documents \\+ 1 = 9"):
        model(ids, cu_seqlens=pad_cu_seqlens(CU, 10), max_documents=8, row_length=LENGTH)
    with pytest.raises(ValueError, match="rows of 50"):
        model(ids, cu_seqlens=pad_cu_seqlens(CU, 10), max_documents=10, row_length=50)
