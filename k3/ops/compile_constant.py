"""torch.compiler.assume_constant_result without importing torch._dynamo (about 1.5 s) when k3's ops are imported:
torch's decorator only sets a mark on the function, but imports all of dynamo to do so. Dynamo reads the mark when
it traces a call, and by then it is imported."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

# The attribute torch._dynamo.decorators.assume_constant_result sets (a test holds ours equal to it).
_MARK = "_dynamo_marked_constant"


def assume_constant_result(fn: F) -> F:
    """fn, marked so that torch.compile calls it once while tracing and keeps its result as a constant (its body,
    an import or a cached lookup, is never traced). Like torch's decorator, nothing checks that it is constant."""
    setattr(fn, _MARK, True)
    return fn
