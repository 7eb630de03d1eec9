"""Sparse MLA (DeepSeek V3.2 DSA; the base of V4's attention): attention over per-token top-k slot lists.

Every query token ``t`` attends to the cache rows its index list names (global slots ``block * block_size +
offset``), in one or two sources (``kv_cache`` and ``extra_kv_cache``) whose keys share one softmax. K is the
dequantised row (``D`` wide), V its first ``d_v`` values. No causal mask beyond the index set.

Kernel design (docs/sparse_mla.md): one program owns (token, a block of up to 64 heads, one split of the
token's key list). It loads q once, streams the selected rows in tiles of ``BLOCK_N`` slots (a gather by
slot; invalid entries are masked and never read), computes q k^T over the first ``d_v`` columns as four
column chunks plus the tail (V3.2: 512 latent + 64 rope), keeps the online softmax in fp32 registers and
accumulates P V. The extra source runs through the same loop into the same state. The cache format is a
constexpr branch of :func:`_load_kv_rows` (bf16/fp16/fp32 rows, the 656-byte ``fp8_ds_mla`` row or V4's
block-split 584-byte ``fp8_v4`` row, dequantised in registers). The compute dtype is q's (fp32 q: fp32 operands and
``ieee`` dots, the CPU oracle configuration; fp32 for bf16 under the interpreter, where bf16 is raw uint16). The
epilogue normalises, applies the sink to ``out`` only, rotates V4's rope dims back by the token's angle (optional)
and writes ``out`` and the sink-free LSE, or, with several splits, a normalised fp32 partial + LSE that
:func:`_sparse_mla_merge_fwd_kernel` merges (sink and rotation there). The split count comes from
:func:`_num_splits` (fill the SMs when tokens x head blocks cannot).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET, compute_dtype
from openmla.ops._bf16 import to_bf16
from openmla.ops._validate import FLOAT16_DTYPES, capturing, check_no_overlap, check_tensor, describe
from openmla.ops.rope import check_rope_table, load_cos_sin, rope_pairs

__all__ = ["SPARSE_KV_CACHE_DTYPES", "apply_attn_sink", "sparse_mla"]

SPARSE_KV_CACHE_DTYPES = ("auto", "fp8_ds_mla", "fp8_v4")
_FORMATS = {"auto": 0, "fp8_ds_mla": 1, "fp8_v4": 2}
_DS_MLA_ROW_BYTES = 656  # 512 e4m3 + 4 fp32 scales + 64 bf16 (SPEC §2.3)
# fp8_v4 (SPEC §2.4, openmla/ops/cache_v4.py): per token 448 e4m3 + 64 bf16 at p * 576 in its block, and its 7 UE8M0
# exponents at block_size * 576 + p * 8
_V4_TOKEN_BYTES = 584
_V4_DATA_BYTES = 576
_LOG2E = 1.4426950408889634

# Tiles on the GPU, (rows of heads, cache format) -> (BLOCK_N, num_warps, num_stages). 64-row tiles issue wgmma
# (8 warps: the scores dot runs as m64n{BLOCK_N / 2}k16 in both warpgroups, P V as m64n64k16); 16-32 rows
# mma.sync. Wider key tiles cost fewer instructions a key (sm90 offline SASS, docs/sparse_mla.md "H200 figures").
# Not yet timed on the H200 (``openmla bench --family sparse --shapes sweep`` times the alternatives).
_GPU_TILING = {
    (16, 0): (64, 4, 3),
    (32, 0): (64, 8, 2),
    (64, 0): (32, 8, 2),  # 64-key tiles spill at 64 heads with an extra source (8-48 bytes, sm90 offline report)
    (16, 1): (32, 4, 2),
    (32, 1): (64, 8, 2),  # 29% fewer loop instructions a key than 32-key tiles, no spill (sm90 offline)
    (64, 1): (32, 8, 2),  # 64-key tiles spill 72-80 bytes with an extra source
    (16, 2): (32, 4, 2),
    (32, 2): (64, 8, 2),  # 26% fewer loop instructions a key than 32-key tiles, no spill (sm90 offline)
    (64, 2): (32, 8, 3),  # 64 keys spill 56-80 bytes with an extra source (2 or 3 stages: within 1.4% in the loop)
}
# one source (no extra_kv_cache; V3.2 decode and prefill, a gathered V4 workspace): 64-key tiles at 64 heads do not
# spill; the scores dot becomes m64n32k16 (40% less operand traffic from shared memory a key than m64n16k16) and the
# loop 17-22% fewer instructions a key (sm90 offline SASS)
_GPU_TILING_ONE_SOURCE = {
    (64, 0): (64, 8, 2),
    (64, 1): (64, 8, 2),
    (64, 2): (64, 8, 2),
}
# thread blocks of one tile an SM holds (sm90 offline: registers x threads, shared memory); the split planner fills
# this many per SM. 16 rows: 197-252 registers x 128 threads, <= 107 KB; 32-64 rows: 147-255 x 256 threads.
_CTAS_PER_SM = {16: 2, 32: 1, 64: 1}
_MAX_BLOCK_H = 64  # heads per program at most (H = 128 runs two head blocks over the same rows)
_INTERPRET_BLOCK_N = 16
# fp32 q (tests, the CPU oracle engine) on the GPU: 16-key tiles for fp8 rows, half-length ones for 16-bit rows, at
# most 2 stages, since fp32 rows are twice as wide in shared memory (untuned)
_FP32_MIN_BLOCK_N = 16
_FP32_MAX_STAGES = 2
# the interpreter: NaN e4m3 bytes need an explicit test, fp32 -> bf16 an explicit round to nearest even
_INTERPRET_FIX = tl.constexpr(INTERPRET)
# split planner: with fewer programs (tokens x head blocks) than one wave of thread blocks (SMs x _CTAS_PER_SM),
# cut each token's key list into as many splits as keep the programs within that wave, each of at least
# _MIN_SPLIT_KEYS keys (one 64-key tile: at batch 1 on the H200 a tile a split is the fastest, V3.2 h128 top-k 2048
# 15.1 us against 18.9 at two tiles), at most _MAX_SPLITS of them
_MIN_SPLIT_KEYS = 64
_MAX_SPLITS = 32
# split merge: a program merges up to _MERGE_BLOCK_H heads x _MERGE_BLOCK_D columns of one token over all its
# splits, _MERGE_SPLIT_ROWS (heads x splits) at most (fewer heads when there are many splits)
_MERGE_BLOCK_H = 16
_MERGE_BLOCK_D = 128
_MERGE_SPLIT_ROWS = 32
_SINK_BLOCK_H = 16
_SINK_BLOCK_D = 128


@triton.jit
def _sink_factor(b_lse, b_sink):
    """``sigmoid(lse - sink)`` per row, 0 for an empty row (lse -inf); sink -inf gives 1, +inf gives 0."""
    empty = b_lse == float("-inf")
    e = tl.exp2((b_sink - tl.where(empty, 0.0, b_lse)) * 1.4426950408889634)
    return tl.where(empty, 0.0, 1.0 / (1.0 + e))


@triton.jit
def _load_kv_rows(p_kv, p_f32, p_b16, m_n, o_c, o_r, FMT: tl.constexpr, DC: tl.constexpr, D_V: tl.constexpr,
                  D_T: tl.constexpr, D_TP: tl.constexpr, COMPUTE: tl.constexpr, F16_DEQUANT: tl.constexpr):  # fmt: skip
    """A tile of gathered cache rows as four column chunks [N, DC] of the first D_V values and the tail
    [N, D_TP] (columns D_V..D; zeros where masked or beyond D_T). ``p_kv`` [N]: each row's start in the cache's
    element type (bytes for FMT 1); ``p_f32`` / ``p_b16``: the same addresses as fp32 / bf16 pointers (FMT 1).
    FMT 0: bf16/fp16 rows. FMT 1: fp8_ds_mla (656 bytes: 4 x 128 e4m3 with one fp32 scale per 128 at byte 512,
    then 64 bf16 at byte 528); a NaN from dequantising counts as 0. FMT 2: fp8_v4 (D = D_V = 512; ``p_f32`` is
    then the uint8 pointer to the token's 8 exponent bytes, ``p_b16`` its rope part minus 64 values). A new cache
    format is one more branch."""
    m2 = m_n[:, None]
    m_r = m2 & (o_r[None, :] < D_T)
    if FMT == 0:
        k0 = tl.load(p_kv[:, None] + o_c[None, :], mask=m2, other=0.0).to(COMPUTE)
        k1 = tl.load(p_kv[:, None] + DC + o_c[None, :], mask=m2, other=0.0).to(COMPUTE)
        k2 = tl.load(p_kv[:, None] + 2 * DC + o_c[None, :], mask=m2, other=0.0).to(COMPUTE)
        k3 = tl.load(p_kv[:, None] + 3 * DC + o_c[None, :], mask=m2, other=0.0).to(COMPUTE)
        k_r = tl.load(p_kv[:, None] + D_V + o_r[None, :], mask=m_r, other=0.0).to(COMPUTE)
    elif FMT == 1:
        p_s = p_f32 + 128  # the 4 fp32 scales at byte 512
        k0 = _dequant_group(p_kv, p_s, m_n, o_c, 0, COMPUTE, F16_DEQUANT)
        k1 = _dequant_group(p_kv, p_s, m_n, o_c, 1, COMPUTE, F16_DEQUANT)
        k2 = _dequant_group(p_kv, p_s, m_n, o_c, 2, COMPUTE, F16_DEQUANT)
        k3 = _dequant_group(p_kv, p_s, m_n, o_c, 3, COMPUTE, F16_DEQUANT)
        k_r = tl.load(p_b16[:, None] + 264 + o_r[None, :], mask=m_r, other=0.0).to(tl.float32)
        k_r = tl.where(k_r != k_r, 0.0, k_r).to(COMPUTE)  # noqa: PLR0124 (NaN test)
    else:
        k0 = _dequant_v4_chunk(p_kv, p_f32, p_b16, m_n, o_c, 0, COMPUTE)
        k1 = _dequant_v4_chunk(p_kv, p_f32, p_b16, m_n, o_c, 1, COMPUTE)
        k2 = _dequant_v4_chunk(p_kv, p_f32, p_b16, m_n, o_c, 2, COMPUTE)
        k3 = _dequant_v4_chunk(p_kv, p_f32, p_b16, m_n, o_c, 3, COMPUTE)
        k_r = tl.zeros([m_n.shape[0], D_TP], dtype=COMPUTE)  # no tail (D_T = 0): never used
    return k0, k1, k2, k3, k_r


@triton.jit
def _dequant_group(p_kv, p_s, m_n, o_c, G: tl.constexpr, COMPUTE: tl.constexpr, F16_DEQUANT: tl.constexpr):
    """Group G (128 values) of fp8_ds_mla rows: e4m3 bytes x the group's fp32 scale; NaN -> 0. F16_DEQUANT (a
    tuning variant, COMPUTE fp16): widen to fp16 and multiply by the scale rounded to fp16 (one cvt and one
    multiply a pair of values; a scale below 6.1e-5, i.e. a group amax below 0.027, loses bits as a subnormal)."""
    b_q = tl.load(p_kv[:, None] + G * 128 + o_c[None, :], mask=m_n[:, None], other=0)
    b_s = tl.load(p_s + G, mask=m_n, other=0.0)
    if F16_DEQUANT:
        b_v = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float16) * b_s.to(tl.float16)[:, None]
    else:
        b_v = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_s[:, None]
    b_nan = b_v != b_v  # noqa: PLR0124 (NaN test)
    if _INTERPRET_FIX:  # the interpreter widens the e4m3 NaN bytes (0x7F, 0xFF) to +-480; the GPU to NaN
        b_nan = b_nan | ((b_q & 0x7F) == 0x7F)
    return tl.where(b_nan, 0.0, b_v).to(COMPUTE)


@triton.jit
def _v4_scale(p_e, m_n):
    """UE8M0 exponent bytes -> fp32 scales 2^(byte - 127) [N] (byte 255: NaN, byte 0: 2^-127), as cache_v4 reads."""
    b_e = tl.load(p_e, mask=m_n, other=127).to(tl.int32)
    b_s = (b_e << 23).to(tl.float32, bitcast=True)
    return tl.where(b_e == 255, float("nan"), tl.where(b_e == 0, 5.877471754111438e-39, b_s))


@triton.jit
def _dequant_v4_chunk(p_kv, p_e, p_b16, m_n, o_c, C: tl.constexpr, COMPUTE: tl.constexpr):
    """Columns [128 C, 128 C + 128) of fp8_v4 rows: two 64-wide e4m3 groups x their UE8M0 scales; chunk 3 is
    group 6 then the 64 bf16 rope values (``p_b16 + 64..127``). NaN -> 0."""
    lo = o_c[None, :] < 64
    if C == 3:
        b_q = tl.load(p_kv[:, None] + C * 128 + o_c[None, :], mask=m_n[:, None] & lo, other=0)
        b_s = tl.where(lo, _v4_scale(p_e + 6, m_n)[:, None], 1.0)
    else:
        b_q = tl.load(p_kv[:, None] + C * 128 + o_c[None, :], mask=m_n[:, None], other=0)
        b_s = tl.where(lo, _v4_scale(p_e + 2 * C, m_n)[:, None], _v4_scale(p_e + 2 * C + 1, m_n)[:, None])
    b_v = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_s
    if C == 3:
        b_r = tl.load(p_b16[:, None] + o_c[None, :], mask=m_n[:, None] & (o_c[None, :] >= 64), other=0.0)
        b_v = tl.where(lo, b_v, b_r.to(tl.float32))
    b_nan = b_v != b_v  # noqa: PLR0124 (NaN test)
    if _INTERPRET_FIX:  # the interpreter widens the e4m3 NaN bytes (0x7F, 0xFF) to +-480; the GPU to NaN
        b_nan = b_nan | ((b_q & 0x7F) == 0x7F)  # (the rope lanes' b_q is 0)
    return tl.where(b_nan, 0.0, b_v).to(COMPUTE)


@triton.jit
def _tile_update(q0, q1, q2, q3, q_r, k0, k1, k2, k3, k_r, b_m, b_l, a0, a1, a2, a3, m_n, scale_log2,
                 D_T: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax (base 2): scores over the four chunks and the tail, P V over the
    chunks (V = the first D_V columns)."""
    b_s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
    b_s = tl.dot(q1, tl.trans(k1), b_s, input_precision=DOT_PRECISION)
    b_s = tl.dot(q2, tl.trans(k2), b_s, input_precision=DOT_PRECISION)
    b_s = tl.dot(q3, tl.trans(k3), b_s, input_precision=DOT_PRECISION)
    if D_T > 0:
        b_s = tl.dot(q_r, tl.trans(k_r), b_s, input_precision=DOT_PRECISION)  # [M, N]
    b_s = tl.where(m_n[None, :], b_s * scale_log2, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_s - b_m_use[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_p = b_p.to(COMPUTE)
    a0 = tl.dot(b_p, k0, a0 * b_alpha[:, None], input_precision=DOT_PRECISION)
    a1 = tl.dot(b_p, k1, a1 * b_alpha[:, None], input_precision=DOT_PRECISION)
    a2 = tl.dot(b_p, k2, a2 * b_alpha[:, None], input_precision=DOT_PRECISION)
    a3 = tl.dot(b_p, k3, a3 * b_alpha[:, None], input_precision=DOT_PRECISION)
    return b_m_new, b_l, a0, a1, a2, a3


@triton.jit
def _row_span(idx, indptr, lens, i_t, stride_i_t, K, nnz, RAGGED: tl.constexpr, HAS_LEN: tl.constexpr):
    """Token i_t's index row: (pointer to its first entry, number of entries that count). Ragged rows are
    clamped to the flat array and dense lengths to [0, K], so that nothing is read outside a tensor."""
    if RAGGED:
        start = tl.minimum(tl.maximum(tl.load(indptr + i_t).to(tl.int64), 0), nnz)
        end = tl.minimum(tl.maximum(tl.load(indptr + i_t + 1).to(tl.int64), start), nnz)
        p_row = idx + start
        n = (end - start).to(tl.int32)
    else:
        p_row = idx + i_t * stride_i_t
        n = K
        if HAS_LEN:
            n = tl.minimum(tl.maximum(tl.load(lens + i_t), 0), K)
    return p_row, n


@triton.jit
def _source_rows(p_idx, o_i, m_i, kv, kv_f32, kv_b16, stride_kv_b, stride_kv_p, num_slots, PAGE: tl.constexpr,
                 FMT: tl.constexpr):  # fmt: skip
    """Entries o_i [N] (where m_i) of one index row: row pointers (as kv's type, fp32, bf16; FMT 2: the row's
    bytes, its exponent bytes, its rope part - 64 as bf16) and which are valid; a slot < 0 or >= num_slots is
    skipped, never read. The int32 slot is checked and split into (block, offset) as uint32 (>= 0 once checked:
    a shift and a mask for a power-of-two PAGE) and widened for the address arithmetic (int64): 9-15% fewer loop
    instructions than int64 throughout (sm90 offline SASS)."""
    slot = tl.load(p_idx + o_i, mask=m_i, other=-1)
    ok = m_i & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0).to(tl.uint32, bitcast=True)
    i_p = (slot % PAGE).to(tl.int64)
    blk = (slot // PAGE).to(tl.int64) * stride_kv_b
    row = blk + i_p * stride_kv_p
    if FMT == 2:  # stride_kv_p = 576; the exponents follow the block's PAGE data rows
        return kv + row, kv_f32 + blk + PAGE * 576 + i_p * 8, kv_b16 + (row + 448) // 2 - 64, ok
    return kv + row, kv_f32 + row // 4, kv_b16 + row // 2, ok


@triton.jit
def _to_out(x, dtype: tl.constexpr):
    """fp32 -> the output dtype, bf16 rounded to nearest even on both backends."""
    if dtype == tl.bfloat16:
        y = to_bf16(x, _INTERPRET_FIX)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _store_chunks(p_row, o0, o1, o2, o3, m_h, o_c, DC: tl.constexpr):
    """Four [M, DC] column chunks to rows p_row [M] (in the destination's dtype)."""
    dtype: tl.constexpr = p_row.dtype.element_ty
    tl.store(p_row[:, None] + o_c[None, :], _to_out(o0, dtype), mask=m_h[:, None])
    tl.store(p_row[:, None] + DC + o_c[None, :], _to_out(o1, dtype), mask=m_h[:, None])
    tl.store(p_row[:, None] + 2 * DC + o_c[None, :], _to_out(o2, dtype), mask=m_h[:, None])
    tl.store(p_row[:, None] + 3 * DC + o_c[None, :], _to_out(o3, dtype), mask=m_h[:, None])


@triton.jit
def _sparse_mla_fwd_kernel(
    q,  # [T, H, D]
    kv,  # [num_blocks, PAGE, D] (FMT 0), uint8 [num_blocks, PAGE, 656] (FMT 1) or fp8_v4 bytes (FMT 2)
    kv_f32,  # FMT 1: the same memory as fp32 (FMT 2: as uint8)
    kv_b16,  # FMT 1, 2: the same memory as bf16
    idx,  # [T, K] (dense) or [nnz] (RAGGED)
    indptr,  # [T + 1] (RAGGED)
    lens,  # [T] (HAS_LEN)
    ekv,  # the extra source, like kv (HAS_EXTRA)
    ekv_f32,
    ekv_b16,
    eidx,
    eindptr,
    elens,
    sink,  # [H] fp32 (HAS_SINK)
    out,  # [T, H, D_V]
    lse,  # [T, H] fp32
    o_part,  # [NUM_SPLITS, T, H, D_V] fp32 (NUM_SPLITS > 1)
    lse_part,  # [NUM_SPLITS, T, H] fp32
    rope_pos,  # [T] int (HAS_ROPE): the token's position, whose angle the output's last ROPE dims undo
    cos_sin,  # [P, ROPE] fp32 (HAS_ROPE): [cos | sin] per position (openmla/ops/rope.py)
    scale_log2,  # sm_scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_kv_b,
    stride_kv_p,
    stride_ekv_b,
    stride_ekv_p,
    stride_i_t,
    stride_ei_t,
    stride_o_t,
    stride_o_h,
    stride_l_t,
    stride_cs,
    num_pos,
    T,
    H,
    K,
    EK,
    nnz,
    e_nnz,
    num_slots,
    e_num_slots,
    PAGE: tl.constexpr,
    E_PAGE: tl.constexpr,
    FMT: tl.constexpr,
    D_V: tl.constexpr,
    D_T: tl.constexpr,
    D_TP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    N_HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    RAGGED: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    E_RAGGED: tl.constexpr,
    E_HAS_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE: tl.constexpr,
    COMPUTE: tl.constexpr,
    F16_DEQUANT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    DC: tl.constexpr = D_V // 4
    # a token's head blocks are adjacent programs, so that they run together and all but the first read the
    # token's rows from L2 (with the token as the slow axis, H = 128 read every row from HBM twice)
    i_hb = tl.program_id(0) % N_HB
    i_t = (tl.program_id(0) // N_HB).to(tl.int64)
    i_s = tl.program_id(1)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H  # heads past H pad the tile inside the kernel (no padded copy of q)
    o_c = tl.arange(0, DC)
    o_r = tl.arange(0, D_TP)

    # this program's part of the token's key list: main entries [0, n1), then extra entries [n1, n1 + n2)
    p_idx, n1 = _row_span(idx, indptr, lens, i_t, stride_i_t, K, nnz, RAGGED, HAS_LEN)
    n2 = 0
    p_eidx = p_idx
    if HAS_EXTRA:
        p_eidx, n2 = _row_span(eidx, eindptr, elens, i_t, stride_ei_t, EK, e_nnz, E_RAGGED, E_HAS_LEN)
    n = n1 + n2
    chunk = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, n)

    p_q = q + i_t * stride_q_t + o_h * stride_q_h  # [BLOCK_H]
    m_q = m_h[:, None]
    q0 = tl.load(p_q[:, None] + o_c[None, :], mask=m_q, other=0.0).to(COMPUTE)
    q1 = tl.load(p_q[:, None] + DC + o_c[None, :], mask=m_q, other=0.0).to(COMPUTE)
    q2 = tl.load(p_q[:, None] + 2 * DC + o_c[None, :], mask=m_q, other=0.0).to(COMPUTE)
    q3 = tl.load(p_q[:, None] + 3 * DC + o_c[None, :], mask=m_q, other=0.0).to(COMPUTE)
    q_r = tl.load(p_q[:, None] + D_V + o_r[None, :], mask=m_q & (o_r[None, :] < D_T), other=0.0).to(COMPUTE)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    a0 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    # one loop over the concatenated list, so that the extra source costs no second copy of the loop (which
    # spilled at 64 heads); a tile that straddles the two sources takes each row from its own cache
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < hi
        p_kv, p_f32, p_b16, ok = _source_rows(p_idx, o_n, m_n & (o_n < n1), kv, kv_f32, kv_b16, stride_kv_b,
                                              stride_kv_p, num_slots, PAGE, FMT)  # fmt: skip
        if HAS_EXTRA:
            e_kv, e_f32, e_b16, e_ok = _source_rows(p_eidx, o_n - n1, m_n & (o_n >= n1), ekv, ekv_f32, ekv_b16,
                                                    stride_ekv_b, stride_ekv_p, e_num_slots, E_PAGE, FMT)  # fmt: skip
            p_kv = tl.where(ok, p_kv, e_kv)
            p_f32 = tl.where(ok, p_f32, e_f32)
            p_b16 = tl.where(ok, p_b16, e_b16)
            ok = ok | e_ok
        k0, k1, k2, k3, k_r = _load_kv_rows(p_kv, p_f32, p_b16, ok, o_c, o_r, FMT, DC, D_V, D_T, D_TP, COMPUTE,
                                            F16_DEQUANT)  # fmt: skip
        b_m, b_l, a0, a1, a2, a3 = _tile_update(q0, q1, q2, q3, q_r, k0, k1, k2, k3, k_r, b_m, b_l, a0, a1, a2,
                                                a3, ok, scale_log2, D_T, COMPUTE, DOT_PRECISION)  # fmt: skip

    # epilogue: normalise; natural-log LSE of the scaled scores (sink-free); -inf and 0 for an empty row
    empty = b_l == 0.0
    b_lse = tl.where(empty, float("-inf"), (b_m + tl.log2(tl.where(empty, 1.0, b_l))) * 0.6931471805599453)
    b_r = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, b_l))
    if NUM_SPLITS == 1:
        if HAS_SINK:
            b_r = b_r * _sink_factor(b_lse, tl.load(sink + o_h, mask=m_h, other=float("-inf")))
        b_r = b_r[:, None]
        tl.store(lse + i_t * stride_l_t + o_h, b_lse, mask=m_h)
        a3 = a3 * b_r
        if HAS_ROPE:  # a rotation is linear: it commutes with the row scaling (normalisation, sink)
            a3 = _inverse_rope_tail(a3, rope_pos, i_t, cos_sin, stride_cs, num_pos, BLOCK_H, DC, ROPE)
        _store_chunks(out + i_t * stride_o_t + o_h * stride_o_h, a0 * b_r, a1 * b_r, a2 * b_r, a3, m_h,
                      o_c, DC)  # fmt: skip
    else:
        b_r = b_r[:, None]
        part = (i_s * T + i_t) * H + o_h  # [BLOCK_H]
        tl.store(lse_part + part, b_lse, mask=m_h)
        _store_chunks(o_part + part * D_V, a0 * b_r, a1 * b_r, a2 * b_r, a3 * b_r, m_h, o_c, DC)


@triton.jit
def _inverse_rope_tail(x, rope_pos, i_t, cos_sin, stride_cs, num_pos, M: tl.constexpr, N: tl.constexpr,
                       ROPE: tl.constexpr):  # fmt: skip
    """fp32 ``x [M, N]`` (the heads' last N output columns) with its last ROPE columns rotated by minus token
    i_t's angle (SPEC §7.8); a position outside [0, num_pos) leaves them unchanged."""
    pos = tl.load(rope_pos + i_t).to(tl.int64) + tl.zeros([M], dtype=tl.int64)
    b_cos, b_sin = load_cos_sin(cos_sin, pos, stride_cs, num_pos, ROPE // 2, N, N - ROPE)
    return rope_pairs(x, b_cos, b_sin, M, N, True)


@triton.jit
def _sparse_mla_merge_fwd_kernel(
    o_part,  # [S, T, H, D_V] fp32, normalised partials
    lse_part,  # [S, T, H] fp32
    sink,  # [H] fp32 (HAS_SINK)
    out,  # [T, H, D_V]
    lse,  # [T, H] fp32
    rope_pos,  # [T] int (HAS_ROPE)
    cos_sin,  # [P, ROPE] fp32 (HAS_ROPE)
    stride_o_t,
    stride_o_h,
    stride_l_t,
    stride_cs,
    num_pos,
    T,
    H,
    S: tl.constexpr,
    S_P: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE: tl.constexpr,
):
    # LSE merge of the splits of one token for BLOCK_H heads x BLOCK_D columns. The split loop is unrolled and no
    # load waits on another (the partials' addresses do not depend on the LSEs), so all of them are in flight at
    # once; a split of weight 0 (no key) may hold anything, so its values are zeroed after the load
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i_d = tl.program_id(2)
    m_h = o_h < H
    o_s = tl.arange(0, S_P)
    b_ls = tl.load(lse_part + (o_s[:, None] * T + i_t) * H + o_h[None, :],
                   mask=(o_s[:, None] < S) & m_h[None, :], other=float("-inf"))  # fmt: skip
    b_mx = tl.max(b_ls, axis=0)
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    b_den = tl.sum(tl.exp2((b_ls - b_mx[None, :]) * 1.4426950408889634), axis=0)  # [BLOCK_H]
    empty = b_den == 0.0
    b_lse = tl.where(empty, float("-inf"), b_mx + tl.log(tl.where(empty, 1.0, b_den)))
    b_r = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, b_den))
    if HAS_SINK:
        b_r = b_r * _sink_factor(b_lse, tl.load(sink + o_h, mask=m_h, other=float("-inf")))
    if i_d == 0:
        tl.store(lse + i_t * stride_l_t + o_h, b_lse, mask=m_h)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(S):
        w = tl.exp2((tl.load(lse_part + (s * T + i_t) * H + o_h, mask=m_h, other=float("-inf")) - b_mx)
                    * 1.4426950408889634)  # fmt: skip
        b_o = tl.load(o_part + ((s * T + i_t) * H + o_h)[:, None] * D_V + o_d[None, :], mask=m_h[:, None], other=0.0)
        acc += tl.where((w > 0.0)[:, None], w[:, None] * b_o, 0.0)
    acc = acc * b_r[:, None]
    if HAS_ROPE:
        if i_d == D_V // BLOCK_D - 1:  # the last chunk holds the rope columns (ROPE <= BLOCK_D)
            acc = _inverse_rope_tail(acc, rope_pos, i_t, cos_sin, stride_cs, num_pos, BLOCK_H, BLOCK_D, ROPE)
    p_out = out + i_t * stride_o_t + o_h[:, None] * stride_o_h + o_d[None, :]
    tl.store(p_out, _to_out(acc, out.dtype.element_ty), mask=m_h[:, None])


@triton.jit
def _apply_attn_sink_fwd_kernel(
    x,  # [T, H, D]
    lse,  # [T, H] fp32
    sink,  # [H] fp32
    y,  # [T, H, D]
    stride_x_t,
    stride_x_h,
    stride_l_t,
    stride_l_h,
    stride_y_t,
    stride_y_h,
    H,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_h = o_h < H
    m = m_h[:, None] & (o_d[None, :] < D)
    b_lse = tl.load(lse + i_t * stride_l_t + o_h * stride_l_h, mask=m_h, other=float("-inf"))
    b_lse = tl.where(b_lse != b_lse, float("-inf"), b_lse)  # noqa: PLR0124 (NaN: an empty part)
    b_f = _sink_factor(b_lse, tl.load(sink + o_h, mask=m_h, other=float("-inf")))
    b_x = tl.load(x + i_t * stride_x_t + o_h[:, None] * stride_x_h + o_d[None, :], mask=m, other=0.0)
    b_y = tl.where(b_f[:, None] == 0.0, 0.0, b_x.to(tl.float32) * b_f[:, None])  # a row with weight 0 is 0
    tl.store(y + i_t * stride_y_t + o_h[:, None] * stride_y_h + o_d[None, :], _to_out(b_y, y.dtype.element_ty), mask=m)


def _check_sink(attn_sink, H: int, dev) -> None:
    check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), shape=(H,), device=dev)


def apply_attn_sink(
    out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor, *, inplace: bool = False
) -> torch.Tensor:
    r"""Apply attention sinks to a finished (merged) attention output: ``out * sigmoid(lse - sink)``.

    The sink is one extra logit per head with a zero value vector (FlashMLA, DeepSeek V4): it only enters
    the denominator, so ``out_sink = out * e^lse / (e^lse + e^sink)``. ``sparse_mla`` returns the sink-free
    LSE so that partial results (splits, ranks, chunks) can be merged exactly first and the sink applied once
    here. A sink of -inf changes nothing, +inf gives 0; a row with lse -inf (no key) gives 0.

    Args:
        out (torch.Tensor): `[T, H, D]`, bf16/fp16/fp32, last dim contiguous.
        lse (torch.Tensor): `[T, H]` fp32, natural-log LSE of the scaled scores, sink-free.
        attn_sink (torch.Tensor): `[H]` fp32 logits.
        inplace (bool): write into ``out`` instead of a new tensor.

    Returns:
        torch.Tensor: `[T, H, D]`, out's dtype.
    """
    check_tensor("out", out, dtypes=FLOAT16_DTYPES + (torch.float32,), ndim=3)
    dev = out.device
    T, H, D = out.shape
    check_tensor("lse", lse, dtypes=(torch.float32,), shape=(T, H), device=dev, last_dim_contiguous=False)
    _check_sink(attn_sink, H, dev)
    if inplace:
        check_no_overlap("out", out)  # written in place: rows sharing memory would take the sink more than once
    y = out if inplace else torch.empty(T, H, D, dtype=out.dtype, device=dev)
    if T and H and D:
        grid = (T, triton.cdiv(H, _SINK_BLOCK_H), triton.cdiv(D, _SINK_BLOCK_D))
        _apply_attn_sink_fwd_kernel[grid](
            out, lse, attn_sink, y, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), y.stride(0),
            y.stride(1), H, D, BLOCK_H=_SINK_BLOCK_H, BLOCK_D=_SINK_BLOCK_D,
        )  # fmt: skip
    return y


_NUM_SMS: dict = {}


def _num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 1  # the interpreter: no split unless asked for (tests pass _num_splits)
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _NUM_SMS:
        _NUM_SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _NUM_SMS[key]


def _num_splits(T: int, head_blocks: int, max_keys: int, num_sms: int, ctas_per_sm: int = 1) -> int:
    """Splits of each token's key list: the most that keep tokens x head blocks x splits within one wave of
    ``num_sms x ctas_per_sm`` thread blocks (1 when the programs alone fill it), each split at least
    _MIN_SPLIT_KEYS keys (of the bound ``max_keys``), at most _MAX_SPLITS. Rounding down: a wave and a part is
    as slow as two (h64 b64 on 132 SMs: 3 splits run 192 programs in 2 waves of 683 keys, 2 splits 128 in one
    of 1024)."""
    programs = T * head_blocks
    slots = num_sms * ctas_per_sm
    if programs == 0 or programs >= slots:
        return 1
    return max(1, min(slots // programs, max_keys // _MIN_SPLIT_KEYS, _MAX_SPLITS))


def _merge_tiling(splits: int, H: int, d_v: int) -> tuple[int, int, int, int]:
    """(S_P, BLOCK_H, BLOCK_D, num_warps) of the split merge: about 32 split rows a program (32 // S_P heads, 1 to
    16), one warp a head up to 4 (on the H200 the fastest of BLOCK_H 1-16 at batch 1 to 128, 2 to 32 splits);
    grid: tokens x head blocks x column chunks, so that a batch of one still fills many SMs."""
    s_p = triton.next_power_of_2(splits)
    block_h = max(1, min(_MERGE_BLOCK_H, triton.next_power_of_2(H), _MERGE_SPLIT_ROWS // s_p))
    return s_p, block_h, min(_MERGE_BLOCK_D, d_v), min(4, block_h)


def _tiling(H: int, fmt: int, fp32: bool = False, extra: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages): heads padded to a power of two from 16 (tl.dot's minimum)
    up to 64 per program; ``extra`` (an extra source) keeps the tiles that do not spill with it; ``fp32`` (fp32 q)
    takes 16-key tiles for fp8 rows, half the two-source table's for 16-bit rows, and caps the stages."""
    block_h = min(_MAX_BLOCK_H, max(16, triton.next_power_of_2(H)))
    if INTERPRET:
        return block_h, _INTERPRET_BLOCK_N, 4, 1
    block_n, num_warps, num_stages = _GPU_TILING[(block_h, fmt)]
    if not extra and not fp32:
        block_n, num_warps, num_stages = _GPU_TILING_ONE_SOURCE.get((block_h, fmt), (block_n, num_warps, num_stages))
    if fp32:  # fp8 rows: 16 keys (wider spill more, sm90 offline); 16-bit rows: half
        block_n = _FP32_MIN_BLOCK_N if fmt else max(_FP32_MIN_BLOCK_N, block_n // 2)
        num_stages = min(num_stages, _FP32_MAX_STAGES)
    return block_h, block_n, num_warps, num_stages


def _check_cache(name: str, cache, kv_cache_dtype: str, q, dev) -> tuple[torch.Tensor, int]:
    """Validate one source's cache for its layout; return it (fp8_v4: as uint8 ``[nb, bs, 584]``) and the format
    number."""
    fmt = _FORMATS[kv_cache_dtype]
    D = q.shape[2]
    if fmt == 2:
        if isinstance(cache, torch.Tensor) and cache.dim() == 4 and cache.shape[2] == 1:
            cache = cache.squeeze(2)  # FlashMLA's [num_blocks, block_size, 1, 584]
        check_tensor(name, cache, dtypes=(torch.uint8, torch.float8_e4m3fn), ndim=3, device=dev)
        nb, bs, width = cache.shape
        if width != _V4_TOKEN_BYTES:
            raise ValueError(f'{name} must be [num_blocks, block_size, 584] for "fp8_v4"; got {describe(cache)}')
        if bs > 1 and cache.stride(1) != _V4_TOKEN_BYTES:
            raise ValueError(f"{name} (fp8_v4) must have row stride 584 (FlashMLA MODEL1); got {cache.stride()}")
        if nb > 1 and (cache.stride(0) < bs * _V4_TOKEN_BYTES or cache.stride(0) % 2):
            raise ValueError(f"{name} (fp8_v4) blocks must be an even number >= {bs * _V4_TOKEN_BYTES} of bytes "
                             f"apart (openmla.allocate_v4_cache); got strides {cache.stride()}")  # fmt: skip
        if cache.storage_offset() % 2:
            raise ValueError(f"{name} (fp8_v4) must start at an even byte (its rope part is bf16)")
        cache = cache.view(torch.uint8)
    elif fmt == 0:
        check_tensor(name, cache, dtypes=(q.dtype,), ndim=3, device=dev)
        if cache.shape[2] != D:
            raise ValueError(f"{name} rows must be {D} wide like q; got {describe(cache)}")
    else:
        check_tensor(name, cache, dtypes=(torch.uint8,), ndim=3, device=dev)
        if cache.shape[2] != _DS_MLA_ROW_BYTES:
            raise ValueError(f'{name} must be uint8 [num_blocks, block_size, 656] for "fp8_ds_mla"; '
                             f"got {describe(cache)}")  # fmt: skip
        if cache.stride(0) % 4 or cache.stride(1) % 4 or cache.storage_offset() % 4:
            raise ValueError(f"{name} rows must be 4-byte aligned for fp8_ds_mla; got strides {cache.stride()}")
    if cache.shape[1] < 1:
        raise ValueError(f"{name} must have a block size >= 1; got {describe(cache)}")
    return cache, fmt


def _cache_views(cache, fmt: int) -> tuple[list, int, int]:
    """The kernel's three views of a cache, its block stride and its row stride (in its element type)."""
    if fmt == 0:
        return [cache] * 3, cache.stride(0), cache.stride(1)
    if fmt == 1:
        return [cache, cache.view(torch.float32), cache.view(torch.bfloat16)], cache.stride(0), cache.stride(1)
    nb, bs = cache.shape[0], cache.shape[1]
    stride_b = cache.stride(0) if nb > 1 else bs * _V4_TOKEN_BYTES  # one block: only its own bytes are read
    return [cache, cache, cache.view(torch.bfloat16)], stride_b, _V4_DATA_BYTES


def _check_rope(positions, cos_sin_cache, T: int, d_v: int, dev, validate: bool):
    """The fused inverse RoPE's arguments: positions [T] int, cos_sin_cache [P, R] float (R a power of two that
    fits the output's last column chunk); returns the positions as a dense tensor."""
    if (positions is None) != (cos_sin_cache is None):
        raise ValueError("inv_rope_positions and cos_sin_cache go together (pass both or neither)")
    r_max = min(d_v // 4, _MERGE_BLOCK_D)
    return check_rope_table("inv_rope_positions", positions, cos_sin_cache, T, r_max, dev, validate)[0]


def _check_indices(name: str, indices, len_name: str, length, T: int, dev, validate: bool):
    """One source's index set: dense ``[T, K]`` (+ optional lengths ``[T]``) or ragged ``(indptr, flat)``.
    Returns (idx, indptr, lens, K, nnz, ragged)."""
    if isinstance(indices, (tuple, list)):
        if len(indices) != 2:
            raise ValueError(f"{name} as a ragged pair must be (indptr [T + 1], flat [nnz]); got {len(indices)} items")
        indptr, flat = indices
        check_tensor(f"{name}[0] (indptr)", indptr, dtypes=(torch.int32,), shape=(T + 1,), device=dev)
        check_tensor(f"{name}[1] (flat)", flat, dtypes=(torch.int32,), ndim=1, device=dev)
        if length is not None:
            raise ValueError(f"{len_name} must be None with ragged {name} (indptr gives the lengths)")
        if validate and not capturing() and T:
            d = indptr[1:] - indptr[:-1]
            if int(indptr[0]) < 0 or bool((d < 0).any()) or int(indptr[-1]) > flat.numel():
                raise ValueError(f"{name}[0] (indptr) must be non-decreasing from >= 0 up to at most "
                                 f"flat's {flat.numel()} entries; got {indptr.tolist()[:8]}...")  # fmt: skip
        return flat, indptr, flat, int(flat.numel()), int(flat.numel()), True
    check_tensor(name, indices, dtypes=(torch.int32,), ndim=2, device=dev)
    if indices.shape[0] != T:
        raise ValueError(f"{name} must have shape [{T}, K] (one row per query token); got {describe(indices)}")
    K = indices.shape[1]
    if length is not None:
        check_tensor(len_name, length, dtypes=(torch.int32,), shape=(T,), device=dev)
        if validate and not capturing() and T:
            lo, hi = int(length.min()), int(length.max())
            if lo < 0 or hi > K:
                raise ValueError(f"{len_name} must lie in [0, {K}] ({name}'s width); got {lo if lo < 0 else hi}")
    return indices, indices, (length if length is not None else indices), K, 0, False


def sparse_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices,
    sm_scale: float,
    *,
    kv_cache_dtype: str = "auto",
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    d_v: int = 512,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices=None,
    extra_topk_length: torch.Tensor | None = None,
    inv_rope_positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = True,
    validate: bool = True,
    _num_splits_override: int | None = None,
    _tiling_override: tuple[int, ...] | None = None,
    _fp16_dequant: bool = False,
    _kernel: str = "auto",
    _gluon_opts: tuple[str, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Sparse MLA attention over per-token top-k slot lists (DeepSeek V3.2 DSA, MQA form; V4's base).

    For each query row ``t`` (decode, verify and prefill rows alike) and head ``h``:
    ``s_j = sm_scale * q[t, h] . K_j`` over the keys ``j`` that row t's index list(s) name,
    ``lse = log sum_j e^{s_j}``, ``out = sum_j e^{s_j - lse} V_j``, with K_j the dequantised cache row
    (``D`` values) and V_j its first ``d_v`` values. Entries < 0 or >= the cache's slots are skipped and never
    read (slot 0 is a real slot); an entry listed twice counts twice.

    Args:
        q (torch.Tensor): `[T, H, D]` bf16/fp16/fp32, last dim contiguous; any H >= 1 (no padding needed).
            V3.2: D = 576 (512 latent + 64 rope), d_v = 512. V4: D = d_v = 512. The products run in q's dtype
            (fp32: fp32 operands, IEEE dots: the CPU oracle configuration; slower on the GPU, tiles untuned).
        kv_cache (torch.Tensor): ``"auto"``: `[num_blocks, block_size, D]` of q's dtype (bf16/fp16/fp32);
            ``"fp8_ds_mla"``: uint8 `[num_blocks, block_size, 656]` (SPEC §2.3: 512 e4m3 in 4 groups of 128, 4 fp32
            group scales, 64 bf16 rope; value = e4m3 * scale), D = 576. Any block size >= 1, any strides of the
            first two dims.
            ``"fp8_v4"`` (DeepSeek V4, SPEC §2.4): uint8 or float8_e4m3fn `[num_blocks, block_size, 584]` (or
            FlashMLA's `[num_blocks, block_size, 1, 584]`) in the block-split MODEL1 layout of
            :func:`openmla.allocate_v4_cache` (448 e4m3 with a UE8M0 exponent per 64 + 64 bf16 rope per token,
            the exponents after the block's rows), D = d_v = 512. The fp8 layouts take any q dtype (rows are
            dequantised to q's compute dtype).
        indices: `[T, K]` int32 global slots (``block * block_size + offset``; any K >= 1), or the ragged pair
            ``(indptr [T + 1] int32, flat [nnz] int32)`` of :func:`openmla.build_ragged_indices_from_dense`.
        sm_scale (float): softmax scale (required; model specific).
        kv_cache_dtype (str): ``"auto"``, ``"fp8_ds_mla"`` or ``"fp8_v4"``, one layout for both sources (V4:
            both caches fp8_v4, or both bf16). With fp8, a NaN produced by dequantising a selected row counts as 0.
        topk_length (torch.Tensor | None): `[T]` int32 in ``[0, K]``: only the first ``topk_length[t]`` entries
            of row t count (dense indices only).
        attn_sink (torch.Tensor | None): `[H]` fp32: an extra logit with a zero value in each head's
            denominator, ``out = out * sigmoid(lse - sink)``; -inf = no sink, +inf gives 0. The returned lse is
            the sink-free one (FlashMLA's rule; :func:`apply_attn_sink` applies a sink after merging).
        d_v (int): the output width; V = the first d_v values of a row (512; d_v / 4 a power of two and
            D - d_v 0 or a power of two >= 16).
        extra_kv_cache, extra_indices, extra_topk_length: a second source (its own block size, the same dtype
            rules, dense or ragged indices) whose keys join the same softmax (FlashMLA's extra_k_cache). V4:
            the SWA window cache as the main source, the compressed (CSA / HCA) cache as the extra one.
        inv_rope_positions (torch.Tensor | None), cos_sin_cache (torch.Tensor | None): V4's output inverse RoPE
            (SPEC §7.8), fused in the epilogue: `[T]` int32/int64 positions and the `[P, R]` ``[cos | sin]`` table
            of :func:`openmla.inverse_rope_rows` (R a power of two <= min(d_v / 4, 128)); the output's last R
            dims, as GPT-J pairs, are rotated by minus row t's angle after normalisation, sink and split merge
            (the same as ``inverse_rope_rows`` on the finished output). A position outside ``[0, P)`` (only
            without ``validate``) leaves the row unrotated. Both or neither.
        out (torch.Tensor | None): `[T, H, d_v]` buffer of q's dtype (last dim contiguous).
        lse (torch.Tensor | None): `[T, H]` fp32 buffer (last dim contiguous).
        return_lse (bool): return the LSE (computed either way).
        validate (bool): host-synchronising checks of ``topk_length`` ranges, ragged ``indptr`` and the
            ``inv_rope_positions`` range (skipped
            while a CUDA graph is captured). Without them the kernel still never reads outside a tensor
            (lengths are clamped to the rows).

    Returns:
        out: `[T, H, d_v]`, q's dtype. A row with no valid key gives 0.
        lse: `[T, H]` fp32, natural-log LSE of the scaled scores, sink-free; -inf for a row with no valid key
        (FlashMLA returns +inf there); None when ``return_lse`` is False.
    """
    check_tensor("q", q, dtypes=FLOAT16_DTYPES + (torch.float32,), ndim=3)
    dev = q.device
    T, H, D = q.shape
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in _FORMATS:  # (a list is not hashable)
        raise ValueError(
            f"kv_cache_dtype must be one of {SPARSE_KV_CACHE_DTYPES} for sparse_mla; got {kv_cache_dtype!r}"
        )
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 0 < d_v <= D:
        raise ValueError(f"d_v must be an int in [1, {D}] (q's last dim); got {d_v!r}")
    d_t = D - d_v
    dc = d_v // 4
    if d_v % 4 or dc < 16 or dc & (dc - 1) or (d_t and (d_t < 16 or d_t & (d_t - 1))):
        raise ValueError(
            f"need d_v / 4 a power of two >= 16 and D - d_v 0 or a power of two >= 16; got D {D}, d_v {d_v}"
        )
    if H < 1:
        raise ValueError(f"q must have at least one head; got {describe(q)}")
    kv_cache, fmt = _check_cache("kv_cache", kv_cache, kv_cache_dtype, q, dev)
    if fmt == 1 and (D != 576 or d_v != 512):
        raise ValueError(
            f"fp8_ds_mla rows hold 512 + 64 values: q must be [T, H, 576] and d_v 512; got {describe(q)}, d_v {d_v}"
        )
    if fmt == 2 and (D != 512 or d_v != 512):
        raise ValueError(f"fp8_v4 rows hold 512 values (V = K): q must be [T, H, 512] and d_v 512; got {describe(q)}, "
                         f"d_v {d_v}")  # fmt: skip
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool) or not math.isfinite(sm_scale):
        raise TypeError(f"sm_scale must be a finite float; got {sm_scale!r}")
    idx, indptr, lens, K, nnz, ragged = _check_indices("indices", indices, "topk_length", topk_length, T, dev, validate)
    has_extra = extra_kv_cache is not None
    if has_extra:
        if extra_indices is None:
            raise ValueError("extra_indices is required with extra_kv_cache")
        extra_kv_cache, _ = _check_cache("extra_kv_cache", extra_kv_cache, kv_cache_dtype, q, dev)
        eidx, eindptr, elens, EK, e_nnz, e_ragged = _check_indices(
            "extra_indices", extra_indices, "extra_topk_length", extra_topk_length, T, dev, validate
        )
    else:
        if extra_indices is not None or extra_topk_length is not None:
            raise ValueError("extra_indices / extra_topk_length need extra_kv_cache")
        eidx, eindptr, elens, EK, e_nnz, e_ragged = idx, indptr, lens, 0, 0, False
    if attn_sink is not None:
        _check_sink(attn_sink, H, dev)
    has_rope = inv_rope_positions is not None or cos_sin_cache is not None
    if has_rope:
        inv_rope_positions = _check_rope(inv_rope_positions, cos_sin_cache, T, d_v, dev, validate)
        rope_args = (inv_rope_positions, cos_sin_cache)
        rope_strides = (cos_sin_cache.stride(0), cos_sin_cache.shape[0])
        rope_dim = cos_sin_cache.shape[1]
    else:
        rope_args, rope_strides, rope_dim = (lse, lse), (0, 0), 2
    if out is None:
        out = torch.empty(T, H, d_v, dtype=q.dtype, device=dev)
    else:
        check_tensor("out", out, dtypes=(q.dtype,), shape=(T, H, d_v), device=dev)
        check_no_overlap("out", out)
    if lse is None:
        lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    else:
        check_tensor("lse", lse, dtypes=(torch.float32,), shape=(T, H), device=dev)
        check_no_overlap("lse", lse)
    # _kernel (private, for tests and benchmarks): "gluon" the sm90 Gluon kernel of openmla/ops/gluon/sparse.py (64-head
    # blocks; ValueError where it does not apply), "triton" the portable kernel below; "auto" takes the Gluon kernel
    # wherever it applies (H200: V3.2 h16-h128 1.15-1.8x the Triton kernel, V4 1.4-2.2x; benchmarks/RESULTS.md)
    if _kernel not in ("auto", "triton", "gluon"):
        raise ValueError(f"_kernel must be 'auto', 'triton' or 'gluon'; got {_kernel!r}")
    use_gluon, why = False, None
    if _kernel == "gluon" or (_kernel == "auto" and q.is_cuda and not INTERPRET):
        from openmla.ops.gluon import sparse as gluon_sparse

        why = gluon_sparse.gluon_sparse_unsupported(q, kv_cache, kv_cache_dtype, d_v, ragged=ragged or e_ragged,
                                                    extra_kv_cache=extra_kv_cache if has_extra else None,
                                                    inv_rope=has_rope)  # fmt: skip
        if why is None and (_tiling_override is not None or _fp16_dequant):
            why = "_tiling_override / _fp16_dequant are Triton-kernel variants"
        use_gluon = why is None
    if _kernel == "gluon" and why is not None:
        raise ValueError(f"sparse_mla(_kernel='gluon') cannot run this call: {why}")
    # _gluon_opts (private, benchmarks / tests): the Gluon kernel's variants (gluon_opts_bits; () the plain code),
    # _kernel="gluon" only; None: the measured defaults (gluon_sparse.DEFAULT_OPTS)
    gluon_bits = 0
    if _gluon_opts is not None and _kernel != "gluon":
        raise ValueError(f"_gluon_opts needs _kernel='gluon'; got _kernel={_kernel!r}")
    if use_gluon:
        opts = gluon_sparse.default_opts(kv_cache_dtype, D, has_extra, H) if _gluon_opts is None else _gluon_opts
        gluon_bits = gluon_sparse.gluon_opts_bits(opts, kv_cache_dtype, D, has_extra, H)
    if T == 0:
        return out, (lse if return_lse else None)

    block_h, block_n, num_warps, num_stages = _tiling(H, fmt, q.dtype == torch.float32, has_extra)
    if use_gluon:
        block_h = gluon_sparse.BLOCK_H
    if _tiling_override is not None:  # (BLOCK_N, num_warps, num_stages) or (BLOCK_H, BLOCK_N, warps, stages)
        over = tuple(int(x) for x in _tiling_override)
        block_h, block_n, num_warps, num_stages = over if len(over) == 4 else (block_h, *over)
    head_blocks = triton.cdiv(H, block_h)
    if _num_splits_override is not None:
        splits = int(_num_splits_override)
        if splits < 1:
            raise ValueError(f"_num_splits_override must be >= 1; got {_num_splits_override!r}")
    else:
        per_sm = 1 if q.dtype == torch.float32 else _CTAS_PER_SM.get(block_h, 1)  # fp32 tiles: not counted
        splits = _num_splits(T, head_blocks, K + EK, _num_sms(dev), per_sm)
    if splits > 1:
        o_part = torch.empty(splits, T, H, d_v, dtype=torch.float32, device=dev)
        lse_part = torch.empty(splits, T, H, dtype=torch.float32, device=dev)
    else:
        o_part, lse_part = lse, lse  # unused
    if use_gluon and _gluon_opts is None:  # the defaults: fp8 staging where it measured faster (one split)
        gluon_bits |= gluon_sparse.fp8_default_bits(kv_cache, extra_kv_cache if has_extra else None, kv_cache_dtype,
                                                       H, splits)  # fmt: skip
    if use_gluon:
        gluon_sparse.sparse_mla_fwd_gluon(q, kv_cache, kv_cache_dtype, idx, topk_length, attn_sink, out, lse, o_part,
                                          lse_part, float(sm_scale) * _LOG2E, splits,
                                          extra_kv_cache=extra_kv_cache if has_extra else None,
                                          extra_indices=eidx if has_extra else None,
                                          extra_topk_length=extra_topk_length if has_extra else None,
                                          inv_rope=rope_args if has_rope else None, opts=gluon_bits)  # fmt: skip
    else:
        # _fp16_dequant (tuning variant, fp8 caches): products in fp16, rows dequantised in fp16 (q rounded to fp16:
        # |q| must stay below 65504)
        f16_dequant = bool(_fp16_dequant) and fmt == 1
        compute = compute_dtype(torch.float16 if f16_dequant else q.dtype)
        views, stride_b, stride_p = _cache_views(kv_cache, fmt)
        ekv = extra_kv_cache if has_extra else kv_cache
        eviews, e_stride_b, e_stride_p = _cache_views(ekv, fmt)
        _sparse_mla_fwd_kernel[(T * head_blocks, splits)](
            q, *views, idx, indptr, lens, *eviews, eidx, eindptr, elens,
            attn_sink if attn_sink is not None else lse, out, lse, o_part, lse_part, *rope_args,
            float(sm_scale) * _LOG2E, q.stride(0), q.stride(1), stride_b, stride_p, e_stride_b, e_stride_p,
            idx.stride(0) if not ragged else 0, eidx.stride(0) if has_extra and not e_ragged else 0,
            out.stride(0), out.stride(1), lse.stride(0), *rope_strides, T, H, K, EK, nnz, e_nnz,
            kv_cache.shape[0] * kv_cache.shape[1], ekv.shape[0] * ekv.shape[1],
            PAGE=kv_cache.shape[1], E_PAGE=ekv.shape[1], FMT=fmt, D_V=d_v, D_T=d_t, D_TP=max(16, d_t),
            BLOCK_H=block_h, N_HB=head_blocks, BLOCK_N=block_n, NUM_SPLITS=splits, RAGGED=ragged,
            HAS_LEN=topk_length is not None, HAS_EXTRA=has_extra, E_RAGGED=e_ragged,
            E_HAS_LEN=extra_topk_length is not None,
            HAS_SINK=attn_sink is not None, HAS_ROPE=has_rope, ROPE=rope_dim, COMPUTE=compute, F16_DEQUANT=f16_dequant,
            DOT_PRECISION="ieee" if compute == tl.float32 else "tf32",
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    if splits > 1:
        s_p, m_h, m_d, m_w = _merge_tiling(splits, H, d_v)
        _sparse_mla_merge_fwd_kernel[(T, triton.cdiv(H, m_h), d_v // m_d)](
            o_part, lse_part, attn_sink if attn_sink is not None else lse, out, lse, *rope_args, out.stride(0),
            out.stride(1), lse.stride(0), *rope_strides, T, H, S=splits, S_P=s_p,
            D_V=d_v, BLOCK_H=m_h, BLOCK_D=m_d, HAS_SINK=attn_sink is not None,
            HAS_ROPE=has_rope, ROPE=rope_dim, num_warps=m_w,
        )  # fmt: skip
    return out, (lse if return_lse else None)
