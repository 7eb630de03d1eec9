"""Varlen (ragged-batch) flash attention for MLA prefill: q/k head dim != v head dim, GQA, causal, fp8.

One Triton kernel, ``_flash_attn_varlen_fwd_kernel``: a program owns one block of ``BLOCK_M`` query rows
of one request and one query head, streams that request's keys in ``BLOCK_N`` tiles with an online
softmax (base 2 inside the kernel), and writes the normalised output and the natural-log LSE.

Head dims: the q/k dim ``d_qk`` is split into a power-of-two part ``D1`` and a rest ``D2`` (192 =
128 + 64, 576 = 512 + 64), two ``tl.dot`` calls accumulate the scores, so no MMA work is wasted on
padding; a rest that is not a power of two, a ``d_qk`` below the minimum dot size (16; 32 for fp8
operands) and ``d_v`` are padded to a power of two with masks.

Causal masking is bottom-right aligned: in a request with ``Lq`` queries and ``Lk`` keys, query ``i``
sees keys ``j <= i + Lk - Lq``. A row that sees no key (``Lk = 0``, or ``i + Lk - Lq < 0``) gets
out = 0 and lse = -inf.

FP8: q, k and v in ``float8_e4m3fn`` with per-tensor fp32 descales (value ~= stored * descale). On a
GPU with fp8 MMA (sm89+) ``q @ k^T`` runs in fp8 with the descales folded into the softmax scale;
``p @ v`` runs in bf16 (v widened from fp8, p in bf16) and the v descale is applied to the output.
The output is bf16. fp32 inputs (for tests and the CPU engine) use exact IEEE dots, not tf32.

Softmax: the row max is taken on the raw scores and the scale is applied inside the exponent
(``exp2(s * scale - m)``, one FMA per score) when ``sm_scale > 0`` (descales are assumed positive);
otherwise, and on the masked (diagonal / boundary) tiles, the scores are scaled first.

Tiles: on a GPU, a short autotune list (``_configs``, keyed on the head dims, GQA group, causality and
dtypes; with ``AUTOTUNE`` False, one fixed tile per head-dim class, ``_fixed_tiling``); under the interpreter
fixed 16 x 16 tiles and no autotuning.

On sm90, bf16 and fp8 inputs with d_qk 192 / d_v 128 go to the Hopper Gluon kernel (``openmla.ops.gluon.prefill``:
warp-specialised TMA producer, ping-pong consumer warpgroups), which is faster than this kernel and than
cuDNN there (benchmarks/RESULTS.md; fp8 1.4-1.6x this kernel's fp8 path); everything else runs the Triton kernel
of this module.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET, compute_dtype
from openmla.ops._validate import capturing, check_index, check_no_overlap, check_tensor, describe, kernel_backend
from openmla.ops.gluon.prefill import flash_attn_varlen_gluon, gluon_prefill_supported

__all__ = ["flash_attn_varlen"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


@triton.jit
def _softmax_pv(
    acc,  # [BLOCK_M, BLOCK_DV] fp32
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32, running max of the scaled scores (base-2 units)
    b_s,  # [BLOCK_M, BLOCK_N] fp32 scores: raw q . k, or already scaled (and masked to -inf) if PRESCALED
    b_v,  # [BLOCK_N, BLOCK_DV] values of the tile
    qk_scale,
    PRESCALED: tl.constexpr,
    SCALE_POS: tl.constexpr,
    MASKED: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update with one tile of scores. On raw scores with SCALE_POS the scale rides in the
    exponent (one FMA per score, ``s * scale - m``) and the row max is taken before scaling (scale > 0);
    otherwise the scores are scaled first."""
    if SCALE_POS and not PRESCALED:
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
    else:
        if not PRESCALED:
            b_s = b_s * qk_scale
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
    if MASKED:
        # a row with no visible key so far keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if SCALE_POS and not PRESCALED:
        b_p = tl.exp2(b_s * qk_scale - m_use[:, None])
    else:
        b_p = tl.exp2(b_s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(b_p.to(PV_DTYPE), b_v.to(PV_DTYPE), acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_tile(
    acc,  # [BLOCK_M, BLOCK_DV] fp32
    l_i,  # [BLOCK_M] fp32
    m_i,  # [BLOCK_M] fp32, running max in base-2 units
    b_q1,  # [BLOCK_M, BLOCK_D1] QK_DTYPE
    b_q2,  # [BLOCK_M, BLOCK_D2] QK_DTYPE (unused unless HAS_D2)
    p_k,  # k + bos_k * stride_kt + i_hk * stride_kh (int64 base)
    p_v,  # v + bos_k * stride_vt + i_hk * stride_vh
    start_n,
    len_k,
    o_diag,  # [BLOCK_M] last visible key per row (CAUSAL)
    qk_scale,  # sm_scale * log2(e) (* descales)
    stride_kt,
    stride_vt,
    D1: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_D2: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK_DTYPE: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_POS: tl.constexpr,
):
    o_n = start_n + tl.arange(0, BLOCK_N)
    m_n = o_n < len_k
    o_d1 = tl.arange(0, BLOCK_D1)
    o_dv = tl.arange(0, BLOCK_DV)
    p_k1 = p_k + o_n[:, None].to(tl.int64) * stride_kt + o_d1[None, :]
    p_v1 = p_v + o_n[:, None].to(tl.int64) * stride_vt + o_dv[None, :]
    # masks: key rows only on the boundary tiles (MASKED), head dims only where padded
    m_k1 = o_d1[None, :] < D1
    m_v1 = o_dv[None, :] < D_V
    if MASKED:
        m_k1 = m_k1 & m_n[:, None]
        m_v1 = m_v1 & m_n[:, None]
    if MASKED or BLOCK_D1 != D1:
        b_k1 = tl.load(p_k1, mask=m_k1, other=0.0)
    else:
        b_k1 = tl.load(p_k1)
    b_s = tl.dot(b_q1, tl.trans(b_k1.to(QK_DTYPE)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if HAS_D2:
        o_d2 = tl.arange(0, BLOCK_D2)
        p_k2 = p_k + o_n[:, None].to(tl.int64) * stride_kt + D1 + o_d2[None, :]
        m_k2 = o_d2[None, :] < D2
        if MASKED:
            m_k2 = m_k2 & m_n[:, None]
        if MASKED or BLOCK_D2 != D2:
            b_k2 = tl.load(p_k2, mask=m_k2, other=0.0)
        else:
            b_k2 = tl.load(p_k2)
        b_s = tl.dot(b_q2, tl.trans(b_k2.to(QK_DTYPE)), b_s, input_precision=DOT_PRECISION)
    if MASKED:
        b_s = b_s * qk_scale
        m_s = m_n[None, :]
        if CAUSAL:
            m_s = m_s & (o_n[None, :] <= o_diag[:, None])
        b_s = tl.where(m_s, b_s, float("-inf"))
    if MASKED or BLOCK_DV != D_V:
        b_v = tl.load(p_v1, mask=m_v1, other=0.0)
    else:
        b_v = tl.load(p_v1)
    return _softmax_pv(acc, l_i, m_i, b_s, b_v, qk_scale, MASKED, SCALE_POS, MASKED, PV_DTYPE, DOT_PRECISION)


@triton.jit
def _flash_attn_varlen_fwd_kernel(
    q,  # [Tq, H_Q, D_QK]
    k,  # [Tk, H_KV, D_QK]
    v,  # [Tk, H_KV, D_V]
    o,  # [Tq, H_Q, D_V]
    lse,  # [Tq, H_Q] fp32 (STORE_LSE)
    cu_seqlens_q,  # [B + 1]
    cu_seqlens_k,  # [B + 1]
    q_descale,  # [1] fp32 (HAS_DESCALE)
    k_descale,  # [1] fp32 (HAS_DESCALE)
    v_descale,  # [1] fp32 (HAS_DESCALE)
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,  # H_Q // H_KV
    D1: tl.constexpr,  # d_qk = D1 + D2: D1 a power of two (BLOCK_D1 > D1 only when d_qk < 16)
    BLOCK_D1: tl.constexpr,
    D2: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    HAS_D2: tl.constexpr,  # D2 > 0
    D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HAS_DESCALE: tl.constexpr,
    QK_DTYPE: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else "tf32" (unused by 8/16-bit dots)
    SCALE_POS: tl.constexpr,  # sm_scale > 0 (descales are > 0): the scale can be applied after the row max
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_m, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if CAUSAL:
        # the last query blocks carry the most keys: launch them first
        i_m = tl.num_programs(0) - 1 - i_m
    # lengths in int32 (loop bounds), row offsets in int64 (addresses)
    bos_q = tl.load(cu_seqlens_q + i_b).to(tl.int64)
    len_q = (tl.load(cu_seqlens_q + i_b + 1).to(tl.int64) - bos_q).to(tl.int32)
    start_m = i_m * BLOCK_M
    if start_m >= len_q:
        return
    bos_k = tl.load(cu_seqlens_k + i_b).to(tl.int64)
    len_k = (tl.load(cu_seqlens_k + i_b + 1).to(tl.int64) - bos_k).to(tl.int32)
    i_hk = i_h // GROUP

    o_m = start_m + tl.arange(0, BLOCK_M)
    m_m = o_m < len_q
    o_d1 = tl.arange(0, BLOCK_D1)
    p_q = q + (bos_q + o_m[:, None]) * stride_qt + i_h * stride_qh
    b_q1 = tl.load(p_q + o_d1[None, :], mask=m_m[:, None] & (o_d1[None, :] < D1), other=0.0).to(QK_DTYPE)
    if HAS_D2:
        o_d2 = tl.arange(0, BLOCK_D2)
        b_q2 = tl.load(p_q + D1 + o_d2[None, :], mask=m_m[:, None] & (o_d2[None, :] < D2), other=0.0)
        b_q2 = b_q2.to(QK_DTYPE)
    else:
        b_q2 = b_q1

    qk_scale = sm_scale * 1.4426950408889634
    if HAS_DESCALE:
        qk_scale = qk_scale * tl.load(q_descale) * tl.load(k_descale)

    # keys [0, n_full) are visible to every row of the block and need no mask; [n_full, n_end) do
    if CAUSAL:
        delta = len_k - len_q
        o_diag = o_m + delta
        n_end = tl.maximum(tl.minimum(len_k, tl.minimum(start_m + BLOCK_M, len_q) + delta), 0)
        n_full = tl.maximum(tl.minimum(len_k, start_m + delta + 1), 0)
    else:
        o_diag = o_m
        n_end = len_k
        n_full = len_k
    n_full = (n_full // BLOCK_N) * BLOCK_N

    p_k = k + bos_k * stride_kt + i_hk * stride_kh
    p_v = v + bos_k * stride_vt + i_hk * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_tile(
            acc, l_i, m_i, b_q1, b_q2, p_k, p_v, start_n, len_k, o_diag, qk_scale, stride_kt, stride_vt,
            D1, BLOCK_D1, D2, BLOCK_D2, D_V, BLOCK_DV, HAS_D2, False, CAUSAL, QK_DTYPE, PV_DTYPE,
            DOT_PRECISION, BLOCK_N, SCALE_POS,
        )  # fmt: skip
    for start_n in range(n_full, n_end, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_tile(
            acc, l_i, m_i, b_q1, b_q2, p_k, p_v, start_n, len_k, o_diag, qk_scale, stride_kt, stride_vt,
            D1, BLOCK_D1, D2, BLOCK_D2, D_V, BLOCK_DV, HAS_D2, True, CAUSAL, QK_DTYPE, PV_DTYPE,
            DOT_PRECISION, BLOCK_N, SCALE_POS,
        )  # fmt: skip

    # empty rows: l = 0, acc = 0 -> out 0, lse -inf
    m_l = l_i > 0
    b_o = acc / tl.where(m_l, l_i, 1.0)[:, None]
    if HAS_DESCALE:
        b_o = b_o * tl.load(v_descale)
    o_dv = tl.arange(0, BLOCK_DV)
    p_o = o + (bos_q + o_m[:, None]) * stride_ot + i_h * stride_oh + o_dv[None, :]
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_m[:, None] & (o_dv[None, :] < D_V))
    if STORE_LSE:
        b_lse = tl.where(m_l, (m_i + tl.log2(tl.where(m_l, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse + (bos_q + o_m) * stride_lt + i_h * stride_lh, b_lse, mask=m_m)


def _configs() -> list[triton.Config]:
    """H200-oriented tiles; BLOCK_M 128 keeps the wgmma M dim full (64 per warpgroup)."""
    tiles = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in tiles]


if INTERPRET:
    _flash_attn_varlen_fwd_tuned = None  # plain kernel with fixed tiles, no autotune
else:
    _flash_attn_varlen_fwd_tuned = triton.autotune(
        configs=_configs(),
        key=["GROUP", "D1", "D2", "D_V", "CAUSAL", "QK_DTYPE"],
    )(_flash_attn_varlen_fwd_kernel)

#: autotune the tiles on a GPU (else ``_fixed_tiling``; tests set it False for one compile per shape)
AUTOTUNE: bool = True

# tiles under the interpreter (and the BLOCK_M used to size the grid there)
_INTERPRET_BLOCK_M = 16
_INTERPRET_BLOCK_N = 16


def _fixed_tiling(row_bytes: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` without autotuning; ``row_bytes`` is one key row plus
    one value row in the padded tile (what each pipeline stage holds per key)."""
    if row_bytes <= 1024:  # 192 + 128 in bf16: K/V stages and q fit the H200's 227 KB of shared memory
        return 128, 64, 8, 2
    return 64, 32, 4, 2


def _split_head_dim(d: int, min_block: int) -> tuple[int, int, int, int]:
    """``d -> (D1, BLOCK_D1, D2, BLOCK_D2)``: a power-of-two part and a (padded) rest, each dot's K at
    least ``min_block`` (16; 32 for fp8 operands)."""
    if d <= min_block:
        return d, min_block, 0, min_block
    d1 = 1 << (d.bit_length() - 1)
    d2 = d - d1
    return d1, d1, d2, max(min_block, triton.next_power_of_2(d2)) if d2 else min_block


def _v_rows_aligned(v: torch.Tensor) -> torch.Tensor:
    """``v`` itself where its base and row strides are multiples of 32 bytes, else a copy whose rows are: on the
    H200 (triton 3.6) the kernel faults (illegal address) on V rows that are 16- but not 32-byte aligned, such as
    the value half of a kv projection at qk_nope 24 (tests/test_prefill.py::test_misaligned_value_rows)."""
    es = v.element_size()
    if v.data_ptr() % 32 == 0 and all(s * es % 32 == 0 for s in v.stride()[:2]):
        return v
    width = -(-v.shape[2] * es // 32) * 32 // es
    buf = torch.empty(v.shape[0], v.shape[1], width, dtype=v.dtype, device=v.device)
    buf[..., : v.shape[2]] = v
    return buf[..., : v.shape[2]]


def _qk_pv_dtypes(dtype: torch.dtype, device: torch.device):
    """Operand dtypes of the two dots (see the module docstring)."""
    if dtype != torch.float8_e4m3fn:
        c = compute_dtype(dtype)
        return c, c
    pv = compute_dtype(torch.bfloat16)
    if not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return tl.float8e4nv, pv
    return pv, pv


def _flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, descales, max_seqlen_q, sm_scale, causal, return_lse,
                           out):  # fmt: skip
    """Allocate the outputs (``out`` may be given), pick tiles, build the grid and launch."""
    Tq, H, d_qk = q.shape
    H_KV, d_v = k.shape[1], v.shape[2]
    B = cu_seqlens_q.shape[0] - 1
    if out is None:
        out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
        out = torch.empty(Tq, H, d_v, dtype=out_dtype, device=q.device)
    lse = torch.empty(Tq, H, dtype=torch.float32, device=q.device) if return_lse else None
    if B == 0 or Tq == 0 or max_seqlen_q == 0 or H == 0:
        return out, lse
    o = out
    QK_DTYPE, PV_DTYPE = _qk_pv_dtypes(q.dtype, q.device)
    D1, BLOCK_D1, D2, BLOCK_D2 = _split_head_dim(d_qk, 32 if QK_DTYPE == tl.float8e4nv else 16)
    BLOCK_DV = max(16, triton.next_power_of_2(d_v))
    v = _v_rows_aligned(v)
    store_lse = lse is not None
    lse_arg = lse if store_lse else o
    has_descale = descales is not None
    q_ds, k_ds, v_ds = descales if has_descale else (cu_seqlens_q, cu_seqlens_q, cu_seqlens_q)
    if INTERPRET:
        bm, bn, warps, stages = _INTERPRET_BLOCK_M, _INTERPRET_BLOCK_N, None, None
    elif AUTOTUNE:
        bm, bn, warps, stages = None, None, None, None
    else:
        bm, bn, warps, stages = _fixed_tiling((BLOCK_D1 + (BLOCK_D2 if D2 else 0) + BLOCK_DV) * q.element_size())
    args = (
        q, k, v, o, lse_arg, cu_seqlens_q, cu_seqlens_k, q_ds, k_ds, v_ds, float(sm_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), lse.stride(0) if store_lse else 0, lse.stride(1) if store_lse else 0,
    )  # fmt: skip
    meta = dict(
        GROUP=H // H_KV, D1=D1, BLOCK_D1=BLOCK_D1, D2=D2, BLOCK_D2=BLOCK_D2, HAS_D2=D2 > 0, D_V=d_v, BLOCK_DV=BLOCK_DV,
        CAUSAL=bool(causal), STORE_LSE=store_lse, HAS_DESCALE=has_descale, QK_DTYPE=QK_DTYPE, PV_DTYPE=PV_DTYPE,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SCALE_POS=float(sm_scale) > 0,
    )  # fmt: skip
    if INTERPRET:
        grid = (triton.cdiv(max_seqlen_q, bm), H, B)
        _flash_attn_varlen_fwd_kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn)
    elif bm is None:

        def grid(m):
            return (triton.cdiv(max_seqlen_q, m["BLOCK_M"]), H, B)

        _flash_attn_varlen_fwd_tuned[grid](*args, **meta)
    else:
        grid = (triton.cdiv(max_seqlen_q, bm), H, B)
        _flash_attn_varlen_fwd_kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return out, lse


def _check_descale(name: str, t, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a 1-element fp32 tensor, got {type(t).__name__}")
    if t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a 1-element fp32 tensor; got {describe(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like q; got {describe(t)}")
    return t.reshape(1)


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_scale: float,
    *,
    causal: bool = True,
    return_lse: bool = True,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Flash attention over a ragged batch; q/k and v head dims may differ (MLA prefill: 192 / 128).

    Request ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key/value rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; with ``Lq`` and ``Lk`` those lengths, query ``i`` (local)
    attends to keys ``j <= i + Lk - Lq`` when ``causal`` (bottom-right aligned), to all ``Lk`` keys
    otherwise. Query head ``h`` uses key/value head ``h // (h_q // h_kv)`` (GQA).

    Args:
        q (torch.Tensor): `[Tq, h_q, d_qk]`, bf16, fp16, fp32 (exact fp32 dots, slow on a GPU) or
            float8_e4m3fn; last dim contiguous.
        k (torch.Tensor): `[Tk, h_kv, d_qk]`, same dtype as q; ``h_q`` a multiple of ``h_kv``.
        v (torch.Tensor): `[Tk, h_kv, d_v]`, same dtype as q.
        cu_seqlens_q (torch.Tensor): `[B + 1]`, int32/int64, non-decreasing, starting at 0.
        cu_seqlens_k (torch.Tensor): `[B + 1]`, int32/int64, non-decreasing, starting at 0.
        max_seqlen_q (int): an upper bound of the query lengths (it sizes the grid; a smaller value
            leaves rows unwritten). Checked when ``validate``.
        max_seqlen_k (int): an upper bound of the key lengths (accepted for API parity; unused).
        sm_scale (float): softmax scale applied to ``q . k`` (required; SPEC §0).
        causal (bool): bottom-right aligned causal mask.
        return_lse (bool): also return the LSE (otherwise ``None`` and no LSE is written).
        q_descale, k_descale, v_descale (torch.Tensor | None): `[1]` fp32 per-tensor dequantisation
            scales of fp8 inputs (value ~= stored * descale); default 1. Only allowed with fp8 inputs.
        out (torch.Tensor | None): `[Tq, h_q, d_v]` buffer of the output dtype to write into.
        backend (str | None): "auto" (default; env ``OPENMLA_PREFILL_BACKEND``): the Hopper Gluon kernel
            (``openmla.ops.gluon.prefill``) where it applies (sm90, bf16 or fp8 with any descales, d_qk 192 /
            d_v 128, TMA-compatible strides), the portable Triton kernel elsewhere; "triton" or "gluon" force one
            ("gluon" raises where it does not apply).
        validate (bool): check ``cu_seqlens_q`` / ``cu_seqlens_k`` (start at 0, do not decrease, end within
            Tq / Tk) and ``max_seqlen_q`` on the host: a device sync on a GPU, skipped while a CUDA graph is
            captured. Pass False for offsets already checked (the chunked-prefill and layer paths do); they
            are then trusted.

    Returns:
        out: `[Tq, h_q, d_v]`, q.dtype (bf16 for fp8 inputs); rows that see no key are 0.
        lse: `[Tq, h_q]`, fp32, natural-log log-sum-exp of the scaled scores ``sm_scale * q . k``
            (descales included); -inf for rows that see no key; None when ``return_lse`` is False.
        Rows past ``cu_seqlens_q[-1]`` are not written.

    Raises:
        TypeError, ValueError: on wrong dtypes, shapes, devices or arguments (the message names them).
    """
    check_tensor("q", q, dtypes=_INPUT_DTYPES, ndim=3)
    dev = q.device
    Tq, H, d_qk = q.shape
    check_tensor("k", k, dtypes=(q.dtype,), ndim=3, device=dev)
    Tk, H_KV = k.shape[0], k.shape[1]
    if k.shape[2] != d_qk:
        raise ValueError(f"k must have the head dim of q ({d_qk}); got k {describe(k)}, q {describe(q)}")
    check_tensor("v", v, dtypes=(q.dtype,), ndim=3, shape=(Tk, H_KV, None), device=dev)
    d_v = v.shape[2]
    if H_KV == 0 or H % H_KV:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({H_KV}); got q {describe(q)}, "
                         f"k {describe(k)}")  # fmt: skip
    if d_qk == 0 or d_v == 0:
        raise ValueError(f"head dims must be positive; got q {describe(q)}, v {describe(v)}")
    check_index("cu_seqlens_q", cu_seqlens_q, ndim=1, device=dev)
    B = cu_seqlens_q.shape[0] - 1
    if B < 0:
        raise ValueError(f"cu_seqlens_q must have B + 1 >= 1 entries; got {describe(cu_seqlens_q)}")
    check_index("cu_seqlens_k", cu_seqlens_k, ndim=1, device=dev, length=B + 1)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # the kernels read dense arrays
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val < 0:
            raise ValueError(f"{name} must be a non-negative int; got {val!r}")
    if not isinstance(sm_scale, numbers.Real) or not math.isfinite(float(sm_scale)):
        raise ValueError(f"sm_scale must be a finite float; got {sm_scale!r}")
    is_fp8 = q.dtype == torch.float8_e4m3fn
    given = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    if not is_fp8 and any(t is not None for _, t in given):
        names = ", ".join(n for n, t in given if t is not None)
        raise ValueError(f"{names} only apply to float8_e4m3fn inputs; got q {describe(q)}")
    descales = None
    if is_fp8 and any(t is not None for _, t in given):
        one = None
        ds = []
        for name, t in given:
            if t is None:
                if one is None:
                    one = torch.ones(1, dtype=torch.float32, device=dev)
                ds.append(one)
            else:
                ds.append(_check_descale(name, t, dev))
        descales = tuple(ds)
    if out is not None:
        out_dtype = torch.bfloat16 if is_fp8 else q.dtype
        check_tensor("out", out, dtypes=(out_dtype,), ndim=3, shape=(Tq, H, d_v), device=dev)
        check_no_overlap("out", out)

    if validate and not capturing():  # the lengths against the arguments (a sync on a GPU)
        for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, Tq), ("cu_seqlens_k", cu_seqlens_k, Tk)):
            lens = cu[1:] - cu[:-1]
            if int(cu[0]) != 0 or (B and int(lens.min()) < 0) or int(cu[-1]) > total:
                raise ValueError(f"{name} must start at 0, not decrease and end at most at {total}; got {cu.tolist()}")
        if B and int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) > max_seqlen_q:
            raise ValueError(f"max_seqlen_q ({max_seqlen_q}) is below the longest query length")

    if _use_gluon(backend, q, k, v, out):
        if is_fp8 and descales is None:
            descales = (torch.ones(1, dtype=torch.float32, device=dev),) * 3
        o, lse = flash_attn_varlen_gluon(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         float(sm_scale), causal=causal, out=out,
                                         descales=descales if is_fp8 else None)  # fmt: skip
        return o, (lse if return_lse else None)
    return _flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, descales, max_seqlen_q, sm_scale, causal,
                                  return_lse, out)  # fmt: skip


def _use_gluon(backend, q, k, v, out) -> bool:
    """Whether ``flash_attn_varlen`` runs the Hopper Gluon kernel (see its ``backend`` argument): on the H200 at
    H128 2 x 8k causal 605 TFLOPS (the Triton kernel 418, cuDNN 570); fp8 at h128 n4096 618 TFLOPS (the Triton
    kernel's fp8 path 434, cuDNN bf16 543)."""
    backend = kernel_backend(backend, "OPENMLA_PREFILL_BACKEND")
    if backend == "triton":
        return False
    fp8 = q.dtype == torch.float8_e4m3fn
    ok = (out is None or out.stride(2) == 1) and gluon_prefill_supported(q, k, v, fp8=fp8)
    if backend == "gluon" and not ok:
        raise ValueError(
            "backend='gluon' needs an sm90 GPU with triton.experimental.gluon, bf16 or float8_e4m3fn q/k/v, "
            f"d_qk 192, d_v 128 and 16-byte aligned token strides; got q {describe(q)}, k {describe(k)}, "
            f"v {describe(v)}"
        )
    return ok
