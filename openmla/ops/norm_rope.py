"""RMSNorm of rows, then GPT-J RoPE on their trailing dims: DeepSeek V4's q / kv preparation in one pass.

V4 normalises its q heads without a weight (``x * rsqrt(mean(x^2) + eps)``, the factor cast to x's dtype first, as
transformers does) and its kv row and LoRA activations with an fp32 weight (normalise in fp32, multiply by the
weight in fp32, cast once), then rotates the last 64 dims of q and kv (``openmla.ops.rope``). In torch that is
~15 small kernels a tensor (casts, a reduction, the pair split, a concatenation); here one kernel reads each row
once and writes it once, with the same roundings: the normed row is rounded to the output dtype before the
rotation, whose fp32 result is rounded again.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET
from openmla.ops._bf16 import to_bf16
from openmla.ops._validate import check_no_overlap, check_tensor, describe
from openmla.ops.rope import _FLOAT_DTYPES, check_rope_table, load_cos_sin, rope_pairs

__all__ = ["rms_norm_rope"]

MAX_D = 16384  # widest row one program holds (V4: 512 heads and kv, 1024-1536 LoRA ranks, hidden 4096-7168)
TILE_VALUES = 4096  # fp32 values a program holds: BLOCK_M = TILE_VALUES // BLOCK_D rows (at most 16)


@triton.jit
def _round_to(y, DT: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """fp32 ``y`` rounded to dtype DT (to nearest even) and back to fp32."""
    if DT == tl.bfloat16:
        y = to_bf16(y, EXACT_ROUND).to(tl.float32)
    elif DT == tl.float16:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _rms_norm_rope_fwd_kernel(
    x,  # [T, H, D] (any strides, last dim contiguous)
    weight,  # [D] (WEIGHTED)
    out,  # [T, H, D] (any strides, last dim contiguous; may be x)
    positions,  # [T] (ROPE)
    cos_sin_cache,  # [P, R] (ROPE)
    stride_x_t,
    stride_x_h,
    stride_o_t,
    stride_o_h,
    stride_cs,
    num_rows,
    num_pos,
    eps,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ROPE: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    DT: tl.constexpr = out.dtype.element_ty
    i_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    i_t = i_m // H
    i_h = i_m % H
    m_m = i_m < num_rows
    o_d = tl.arange(0, BLOCK_D)
    m_x = m_m[:, None] & (o_d < D)[None, :]
    p_x = x + (i_t * stride_x_t + i_h * stride_x_h)[:, None] + o_d[None, :]
    b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / D + eps)  # [M]
    if WEIGHTED:  # fp32 norm times the fp32 weight, cast once
        b_w = tl.load(weight + o_d, mask=o_d < D, other=0.0).to(tl.float32)
        b_y = b_w[None, :] * (b_x * b_r[:, None])
    else:  # the factor in x's dtype, the product rounded as a product of two such values
        b_y = b_x * _round_to(b_r, DT, EXACT_ROUND)[:, None]
    if ROPE:  # rotate the rounded row's last R dims in fp32; rows at a position outside the table stay unrotated
        b_y = _round_to(b_y, DT, EXACT_ROUND)
        pos = tl.load(positions + i_t, mask=m_m, other=-1).to(tl.int64)
        b_cos, b_sin = load_cos_sin(cos_sin_cache, pos, stride_cs, num_pos, R // 2, BLOCK_D, D - R)
        b_rot = rope_pairs(b_y, b_cos, b_sin, BLOCK_M, BLOCK_D, False)
        b_y = tl.where((o_d >= D - R)[None, :], b_rot, b_y)  # the nope dims pass through (inf * 0 stays out)
    p_o = out + (i_t * stride_o_t + i_h * stride_o_h)[:, None] + o_d[None, :]
    if DT == tl.bfloat16:
        tl.store(p_o, to_bf16(b_y, EXACT_ROUND), mask=m_x)
    else:
        tl.store(p_o, b_y.to(DT), mask=m_x)


def rms_norm_rope(
    x: torch.Tensor,
    eps: float,
    *,
    weight: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    r"""RMSNorm each row of ``x``, then (with ``positions``) GPT-J RoPE on its last R dims, in one kernel.

    For a row ``v`` (fp32 values of ``x[t, h]`` or ``x[t]``) with ``r = 1 / sqrt(mean(v^2) + eps)``:
    with ``weight``, ``y = cast(weight * (v * r))`` (V4's weighted RMSNorm: fp32 math, one cast); without,
    ``y = cast(v * cast(r))`` (V4's q-head norm). With ``positions`` and ``cos_sin_cache`` the pairs
    ``(y[n0 + 2k], y[n0 + 2k + 1])``, ``n0 = D - R``, become ``(a c - b s, a s + b c)`` in fp32 at
    ``c, s = cos_sin_cache[positions[t], k], cos_sin_cache[positions[t], R/2 + k]``, cast again; dims below n0
    are the normed values. ``cast`` rounds to x's dtype (to nearest even).

    Args:
        x (torch.Tensor): `[T, D]` or `[T, H, D]`, bf16/fp16/fp32; any strides with a contiguous last dim;
            D <= 16384.
        eps (float): added to the mean square (finite, >= 0).
        weight (torch.Tensor | None): `[D]` float (read as fp32), contiguous.
        positions (torch.Tensor | None): `[T]` int32/int64, each token's position; with ``cos_sin_cache``.
        cos_sin_cache (torch.Tensor | None): `[P, R]` fp32 (bf16/fp16 read as fp32), row p ``[cos | sin]``;
            R even and a power of two, ``R <= D`` and ``D - R`` even.
        out (torch.Tensor | None): x's shape and dtype, last dim contiguous; may be ``x`` itself (in place).
        validate (bool): check ``0 <= positions < P`` (a host sync; skipped while a CUDA graph is captured).
            Unchecked, a row at a position outside the table is normed but not rotated; nothing outside a
            tensor is read.

    Returns:
        torch.Tensor: ``out`` (a new tensor of x's shape and dtype when None).
    """
    check_tensor("x", x, dtypes=_FLOAT_DTYPES)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, D] or [T, H, D]; got {describe(x)}")
    dev, T, D = x.device, x.shape[0], x.shape[-1]
    if not 1 <= D <= MAX_D:
        raise ValueError(f"x's row width must be in [1, {MAX_D}]; got {describe(x)}")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not 0.0 <= float(eps) < float("inf"):
        raise ValueError(f"eps must be a finite float >= 0; got {eps!r}")
    if weight is not None:
        check_tensor("weight", weight, dtypes=_FLOAT_DTYPES, shape=(D,), device=dev)
    if (positions is None) != (cos_sin_cache is None):
        raise ValueError("positions and cos_sin_cache come together (RoPE) or not at all")
    rope = positions is not None
    P = R = 2
    if rope:
        positions, P, R = check_rope_table("positions", positions, cos_sin_cache, T, D, dev, validate)
        if (D - R) % 2:
            raise ValueError(f"the rope pairs must start at an even column: D - R even; got x {describe(x)}, "
                             f"cos_sin_cache {describe(cos_sin_cache)}")  # fmt: skip
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, dtypes=(x.dtype,), shape=tuple(x.shape), device=dev)
        check_no_overlap("out", out)
    x3, o3 = (x, out) if x.dim() == 3 else (x.unsqueeze(1), out.unsqueeze(1))
    H = x3.shape[1]
    rows = T * H
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(D)
    block_m = max(1, min(16, TILE_VALUES // block_d))
    w = weight if weight is not None else x3
    pos, cs = (positions, cos_sin_cache) if rope else (x3, x3)
    _rms_norm_rope_fwd_kernel[(triton.cdiv(rows, block_m),)](
        x3, w, o3, pos, cs, x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
        cos_sin_cache.stride(0) if rope else 0, rows, P, float(eps),
        H=H, D=D, R=R, BLOCK_M=block_m, BLOCK_D=block_d, WEIGHTED=weight is not None, ROPE=rope,
        EXACT_ROUND=INTERPRET, num_warps=8 if block_d >= 8192 else 4,
    )  # fmt: skip
    return out
