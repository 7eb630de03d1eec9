"""fp32 -> bf16 rounding usable inside kernels on the GPU and under the interpreter.

The Triton interpreter truncates when it converts fp32 to bf16; the GPU rounds to nearest even.
``to_bf16`` first rounds the fp32 value onto the bf16 grid (ties to even) when ``EXACT_ROUND`` is set,
so the final cast only meets representable values and both backends store the same bits.
"""

import triton
import triton.language as tl


@triton.jit
def to_bf16(x, EXACT_ROUND: tl.constexpr):
    if EXACT_ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, x, rounded.to(tl.float32, bitcast=True))  # NaN stays NaN
    return x.to(tl.bfloat16)
