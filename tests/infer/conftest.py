import pytest


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These tests run many small ops; on a shared 2-core machine, OpenMP threads that wait on each other
    make them many times slower than a single thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
