"""Numerical kernels of k3: each op has a plain PyTorch path that runs anywhere and, where one exists, a fast path."""
