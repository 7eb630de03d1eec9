"""fp32 -> float8_e4m3fn conversion usable inside kernels on the GPU and under the interpreter.

The Triton interpreter (3.5-3.9) converts fp32 to e4m3 wrongly when rounding carries into the
exponent (127.9 -> 64, 1.99 -> 1.0) and flushes subnormals. ``to_e4m3`` therefore first rounds the
value onto the e4m3 grid (round to nearest even, saturating at +-448) in fp32 arithmetic when
``EXACT_ROUND`` is set (the interpreter), so the final cast only meets representable values.
On the GPU the hardware conversion (``cvt.rn.satfinite``) is used directly. NaN stays NaN on both (the
interpreter's cast would make it a finite value).
"""

import triton
import triton.language as tl


@triton.jit
def to_e4m3(x, EXACT_ROUND: tl.constexpr):
    x = tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if EXACT_ROUND:
        bits = x.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)  # subnormals share the smallest normal exponent's spacing
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        magic = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds to an integer, ties to even
        y = ((x / ulp + magic) - magic) * ulp
        # e4m3fn's NaN is 0x7F (0xFF negative), built from its bits: the interpreter's cast turns NaN into 384
        nan = tl.where(bits < 0, 0xFF, 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        return tl.where(x != x, nan, y.to(tl.float8e4nv))
    return x.to(tl.float8e4nv)
