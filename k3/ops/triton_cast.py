"""fp32 -> bf16 rounding that Triton's CPU interpreter gets right, shared by k3's kernel modules.

Triton 3.x's interpreter casts fp32 to bf16 by truncation, where the compiled cast rounds to nearest even; the CPU
tests (TRITON_INTERPRET=1) would then see numerics a GPU never produces. A kernel module loads this one through
k3.ops.triton_support.kernel_module in its own interpreter mode, because Triton decides between compiling and
interpreting when a function is decorated: a helper decorated in the other mode could not be called.
"""

import triton
import triton.language as tl

from k3.kernels import triton_interpreting

# Whether this import decorated the helper for Triton's CPU interpreter (kernel_module reloads on a change).
INTERPRETED = triton_interpreting()
_CAST_TRUNCATES = tl.constexpr(INTERPRETED)


@triton.jit
def cast_rounded(x, dtype: tl.constexpr):
    """fp32 x in dtype, rounded to nearest even. In the interpreter the bits are rounded first, to a value that
    its truncating cast then keeps exactly, so that the CPU tests see the GPU's numerics."""
    if _CAST_TRUNCATES and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)
