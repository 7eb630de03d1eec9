"""GPT-J (interleaved-pair) rotary embedding on the trailing rope dims of rows, forward or inverse.

DeepSeek V4 rotates the last ``rope_dim`` (64) dims of each 512-wide row as interleaved pairs
``(x[n0 + 2k], x[n0 + 2k + 1])`` with ``n0 = D - rope_dim``. ``cos_sin_cache[pos]`` is
``[cos(pos f_0 .. f_{R/2-1}) | sin(...)]`` (fp32 ``[P, R]``, SPEC §7.2). Forward rotation by the
token's angle: ``(a c - b s, a s + b c)``; inverse (V4's output, SPEC §7.8): ``(a c + b s, b c - a s)``.

``rope_pairs`` and ``load_cos_sin`` are ``@triton.jit`` helpers other kernels call on register tiles
(the compressor here, the sparse-attention epilogue later); ``inverse_rope_rows`` is the standalone op, and
``rope_rows_`` its forward twin for the V4 layer (the indexer's q heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET
from openmla.ops._bf16 import to_bf16
from openmla.ops._validate import FLOAT16_DTYPES, capturing, check_index, check_no_overlap, check_tensor, describe

__all__ = ["check_rope_table", "inverse_rope_rows", "load_cos_sin", "rope_pairs", "rope_rows_"]

_FLOAT_DTYPES = FLOAT16_DTYPES + (torch.float32,)
BLOCK_ROWS = 16  # (token, head) rows per program of inverse_rope_rows


@triton.jit
def load_cos_sin(cos_sin_cache, pos, stride_p, num_pos, HALF: tl.constexpr, N: tl.constexpr, N0: tl.constexpr):
    """cos and sin ``[M, N // 2]`` for the pairs of an N-wide tile whose rope dims start at column N0.

    ``pos [M]``: each tile row's position; pairs before N0 (the nope part) and positions outside
    ``[0, num_pos)`` get the identity (cos 1, sin 0), so the rotation leaves them unchanged.
    """
    o_k = tl.arange(0, N // 2) - N0 // 2  # rope pair index of each pair of the tile
    m_k = (o_k >= 0) & (o_k < HALF)
    m_p = (pos >= 0) & (pos < num_pos)
    p_cs = cos_sin_cache + pos.to(tl.int64)[:, None] * stride_p + tl.where(m_k, o_k, 0)[None, :]
    m = m_p[:, None] & m_k[None, :]
    b_cos = tl.load(p_cs, mask=m, other=1.0).to(tl.float32)
    b_sin = tl.load(p_cs + HALF, mask=m, other=0.0).to(tl.float32)
    return b_cos, b_sin


@triton.jit
def rope_pairs(x, b_cos, b_sin, M: tl.constexpr, N: tl.constexpr, INVERSE: tl.constexpr):
    """Rotate the interleaved pairs of an fp32 tile ``x [M, N]`` by ``b_cos, b_sin [M, N // 2]``
    (the angle, or minus it when INVERSE)."""
    a, b = tl.split(tl.reshape(x, (M, N // 2, 2)))
    if INVERSE:
        a2 = a * b_cos + b * b_sin
        b2 = b * b_cos - a * b_sin
    else:
        a2 = a * b_cos - b * b_sin
        b2 = a * b_sin + b * b_cos
    return tl.reshape(tl.join(a2, b2), (M, N))


@triton.jit
def _rope_rows_fwd_kernel(
    o,  # [T, H, D] (any strides, last dim contiguous)
    positions,  # [T]
    cos_sin_cache,  # [P, R]
    stride_o_t,
    stride_o_h,
    stride_cs,
    num_rows,
    num_pos,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INVERSE: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    # Only the R rope columns are read and written: the nope lanes pass through untouched.
    i_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    i_t = i_m // H
    i_h = i_m % H
    m_m = i_m < num_rows
    pos = tl.load(positions + i_t, mask=m_m, other=-1).to(tl.int64)
    m_m = m_m & (pos >= 0) & (pos < num_pos)  # rows at an unknown position are left unchanged
    o_r = tl.arange(0, R)
    p_o = o + (i_t * stride_o_t + i_h * stride_o_h)[:, None] + (D - R) + o_r[None, :]
    b_x = tl.load(p_o, mask=m_m[:, None], other=0.0).to(tl.float32)
    b_cos, b_sin = load_cos_sin(cos_sin_cache, pos, stride_cs, num_pos, R // 2, R, 0)
    b_y = rope_pairs(b_x, b_cos, b_sin, BLOCK_M, R, INVERSE)
    if o.dtype.element_ty == tl.bfloat16:
        b_y = to_bf16(b_y, EXACT_ROUND)
    tl.store(p_o, b_y.to(o.dtype.element_ty), mask=m_m[:, None])


def inverse_rope_rows(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    validate: bool = True,
) -> torch.Tensor:
    r"""Rotate the rope pairs of each row by minus its token's angle, in place (SPEC §7.8).

    For every token t and head h, with ``n0 = D - R`` and ``pos = positions[t]``,
    ``(a, b) = (o[t, h, n0 + 2k], o[t, h, n0 + 2k + 1])`` becomes ``(a c + b s, b c - a s)`` where
    ``c, s = cos_sin_cache[pos, k], cos_sin_cache[pos, R/2 + k]``. Dims ``[0, n0)`` pass through.
    This undoes V4's forward GPT-J RoPE on the attention output (K = V carries rope on its last dims).

    Args:
        o (torch.Tensor): `[T, H, D]` or `[T, D]` (D = 512 for V4), bf16/fp16/fp32; any strides
            with a contiguous last dim. Modified in place.
        positions (torch.Tensor): `[T]`, int32/int64; the token's absolute position.
        cos_sin_cache (torch.Tensor): `[P, R]` (R = 64, even, a power of two), fp32 (bf16/fp16 read
            as fp32); row p is ``[cos(p f) | sin(p f)]``.
        validate (bool): check ``0 <= positions < P`` (a host synchronisation). Unchecked, rows at a
            position outside the table are left unchanged; nothing outside a tensor is read.

    Returns:
        torch.Tensor: ``o`` itself.
    """
    return _rope_rows("o", o, positions, cos_sin_cache, inverse=True, validate=validate)


def rope_rows_(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, validate: bool = True):
    """:func:`inverse_rope_rows`' forward twin, in place: the pairs become ``(a c - b s, a s + b c)`` (V4's GPT-J
    RoPE on its indexer q heads); the same arguments and rules."""
    return _rope_rows("x", x, positions, cos_sin_cache, inverse=False, validate=validate)


def check_rope_table(pos_name: str, positions, cos_sin_cache, T: int, max_r: int, device, validate: bool):
    """A RoPE's arguments: ``positions [T]`` int and ``cos_sin_cache [P, R]`` float with R a power of two in
    ``[2, max_r]``; with ``validate`` (a host sync, skipped while a CUDA graph is captured) ``0 <= positions < P``.
    Returns (positions as a dense tensor, P, R)."""
    check_index(pos_name, positions, ndim=1, device=device, length=T)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=_FLOAT_DTYPES, ndim=2, device=device)
    P, R = cos_sin_cache.shape
    if R < 2 or R & (R - 1) or R > max_r:
        raise ValueError(f"cos_sin_cache must be [P, R] with R a power of two in [2, {max_r}]; got "
                         f"{describe(cos_sin_cache)}")  # fmt: skip
    if validate and not capturing() and T > 0:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= P:
            raise ValueError(f"{pos_name} span [{lo}, {hi}] but cos_sin_cache has {P} positions")
    return positions.contiguous(), P, R  # read densely (a strided one is copied)


def _rope_rows(name, o, positions, cos_sin_cache, *, inverse: bool, validate: bool) -> torch.Tensor:
    check_tensor(name, o, dtypes=_FLOAT_DTYPES)
    if o.dim() not in (2, 3):
        raise ValueError(f"{name} must be [T, H, D] or [T, D]; got {describe(o)}")
    check_no_overlap(name, o)  # rotated in place: rows sharing memory would be rotated more than once
    dev = o.device
    T, D = o.shape[0], o.shape[-1]
    positions, P, R = check_rope_table("positions", positions, cos_sin_cache, T, D, dev, validate)
    o3 = o if o.dim() == 3 else o.unsqueeze(1)
    H = o3.shape[1]
    rows = T * H
    if rows == 0:
        return o
    _rope_rows_fwd_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
        o3, positions, cos_sin_cache, o3.stride(0), o3.stride(1), cos_sin_cache.stride(0), rows, P,
        H=H, D=D, R=R, BLOCK_M=BLOCK_ROWS, INVERSE=inverse, EXACT_ROUND=INTERPRET,
    )  # fmt: skip
    return o
