"""Exact merge of two normalised attention partials by their log-sum-exps (chunked context, splits).

For each token ``t`` and head ``h``, with ``a = lse_a[t, h]`` and ``b = lse_b[t, h]`` (natural log; +inf
and NaN count as -inf, i.e. an empty part): ``m = max(a, b)``, ``wa = e^(a - m)``, ``wb = e^(b - m)``,
``out = (wa * out_a + wb * out_b) / (wa + wb)`` and ``lse = m + log(wa + wb)``. A part with weight 0 is
not read at all (its rows may hold garbage or NaN); two empty parts give out = 0 and lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET
from openmla.ops._validate import check_no_overlap, check_tensor, describe

__all__ = ["merge_attn_states"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _merge_attn_states_fwd_kernel(
    o_a,  # [T, H, D]
    lse_a,  # [T, H] fp32
    o_b,  # [T, H, D]
    lse_b,  # [T, H] fp32
    o,  # [T, H, D]
    lse,  # [T, H] fp32
    stride_oa_t,
    stride_oa_h,
    stride_la_t,
    stride_la_h,
    stride_ob_t,
    stride_ob_h,
    stride_lb_t,
    stride_lb_h,
    stride_o_t,
    stride_o_h,
    stride_l_t,
    stride_l_h,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_t, i_hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_la = tl.load(lse_a + i_t * stride_la_t + o_h * stride_la_h, mask=m_h, other=float("-inf"))
    b_lb = tl.load(lse_b + i_t * stride_lb_t + o_h * stride_lb_h, mask=m_h, other=float("-inf"))
    # +inf (FA2's empty row) and NaN count as an empty part
    b_la = tl.where((b_la != b_la) | (b_la == float("inf")), float("-inf"), b_la)
    b_lb = tl.where((b_lb != b_lb) | (b_lb == float("inf")), float("-inf"), b_lb)
    b_m = tl.maximum(b_la, b_lb)
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
    b_wa = tl.exp2((b_la - b_m) * 1.4426950408889634)  # [BLOCK_H]; 0 for an empty part
    b_wb = tl.exp2((b_lb - b_m) * 1.4426950408889634)
    b_den = b_wa + b_wb
    m_any = b_den > 0
    b_inv = 1.0 / tl.where(m_any, b_den, 1.0)
    b_ca = b_wa * b_inv
    b_cb = b_wb * b_inv
    m_a = m_h & (b_wa > 0)
    m_b = m_h & (b_wb > 0)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        p_a = o_a + i_t * stride_oa_t + o_h[:, None] * stride_oa_h + o_d[None, :]
        p_b = o_b + i_t * stride_ob_t + o_h[:, None] * stride_ob_h + o_d[None, :]
        b_a = tl.load(p_a, mask=m_a[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_b = tl.load(p_b, mask=m_b[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_o = b_a * b_ca[:, None] + b_b * b_cb[:, None]
        p_o = o + i_t * stride_o_t + o_h[:, None] * stride_o_h + o_d[None, :]
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])
    b_lse = tl.where(m_any, b_m + tl.log(tl.where(m_any, b_den, 1.0)), float("-inf"))
    tl.store(lse + i_t * stride_l_t + o_h * stride_l_h, b_lse, mask=m_h)


def _merge_attn_states_fwd(out_a, lse_a, out_b, lse_b, out, out_lse):
    """Pick tiles and launch; writes ``out`` and ``out_lse``."""
    T, H, D = out_a.shape
    BLOCK_D = min(triton.next_power_of_2(D), 128 if not INTERPRET else 512)
    # about 2K elements per tile on the GPU (memory-bound: many small programs); one tile per token
    # under the interpreter, where each program costs Python overhead
    BLOCK_H = min(triton.next_power_of_2(H), max(1, (2048 if not INTERPRET else 8192) // BLOCK_D))
    grid = (T, triton.cdiv(H, BLOCK_H))
    _merge_attn_states_fwd_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, out_lse,
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
        out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
        out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
        H=H, D=D, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4,
    )  # fmt: skip


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Merge two attention partials over disjoint key sets into the attention over their union.

    Args:
        out_a (torch.Tensor): `[T, H, D]`, bf16/fp16/fp32; normalised output of part a; last dim contiguous.
        lse_a (torch.Tensor): `[T, H]`, fp32, natural-log LSE of part a (any strides, so an `[H, T]`
            tensor may be passed transposed); -inf, +inf or NaN mark an empty part.
        out_b (torch.Tensor): `[T, H, D]`, bf16/fp16/fp32; part b.
        lse_b (torch.Tensor): `[T, H]`, fp32, natural log; part b.
        out (torch.Tensor | None): `[T, H, D]` buffer (dtype bf16/fp16/fp32); default a new tensor of
            ``out_a.dtype``. May be ``out_a`` or ``out_b`` itself (in-place merge).
        out_lse (torch.Tensor | None): `[T, H]` fp32 buffer; may be ``lse_a`` or ``lse_b`` itself.

    Returns:
        out: `[T, H, D]`; the merged output (0 where both parts are empty).
        lse: `[T, H]`, fp32, natural log; -inf where both parts are empty.

    Raises:
        TypeError, ValueError: on wrong dtypes, shapes or devices (the message names the argument).
    """
    check_tensor("out_a", out_a, dtypes=_OUT_DTYPES, ndim=3)
    dev = out_a.device
    T, H, D = out_a.shape
    check_tensor("out_b", out_b, dtypes=_OUT_DTYPES, shape=(T, H, D), device=dev)
    check_tensor("lse_a", lse_a, dtypes=(torch.float32,), shape=(T, H), device=dev, last_dim_contiguous=False)
    check_tensor("lse_b", lse_b, dtypes=(torch.float32,), shape=(T, H), device=dev, last_dim_contiguous=False)
    if out is None:
        out = torch.empty(T, H, D, dtype=out_a.dtype, device=dev)
    else:
        check_tensor("out", out, dtypes=_OUT_DTYPES, shape=(T, H, D), device=dev)
        check_no_overlap("out", out)
    if out_lse is None:
        out_lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    else:
        check_tensor("out_lse", out_lse, dtypes=(torch.float32,), shape=(T, H), device=dev, last_dim_contiguous=False)
    if D == 0 and T * H:
        raise ValueError(f"out_a must have a positive head dim; got {describe(out_a)}")
    if T == 0 or H == 0:
        return out, out_lse
    _merge_attn_states_fwd(out_a, lse_a, out_b, lse_b, out, out_lse)
    return out, out_lse
