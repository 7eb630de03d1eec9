"""DeepSeek V3.2 lightning indexer: the paged key cache, the scores pass and the causal top-k (docs/indexer.md).

Key cache layouts (``cache_dtype``):
    ``"auto"``: ``[num_blocks, block_size, D]`` in bf16/fp16 (fp32 allowed for tests), one key per row.
    ``"fp8"``: uint8 ``[num_blocks, block_size, D + 4]`` holding a block-split layout (SPEC §2.5): each block
        is ``block_size * D`` e4m3 key bytes (token after token) followed by ``block_size`` fp32 scales;
        ``scale = max(amax, 1e-4) / 448`` (rounded up to a power of two for ``scale_fmt="ue8m0"``) and
        ``key ~= e4m3 * scale``. The ``[block_size, D + 4]`` shape only sizes the block: a row is not a token.

Scores (``indexer_logits``): ``I[t, p] = sum_h relu(q[t, h] . k[p]) * weights[t, h]`` for ``p <= pos_t``
(``pos_t = seq_len - qlen + j`` for the j-th query row of its request), -inf elsewhere; the caller folds every
scale (``D^-0.5``, ``H^-0.5``, an fp8 q's per-head scale) into ``weights``. One program owns (request, a split of
keys, a split of its query rows): it loads each key tile once and scores every query row and index head it owns
against it (the heads x rows are the N side of one ``tl.dot``), so a decode step reads the cache once per request.
Top-k (``indexer_topk``): a per-row radix select (or ``torch.topk`` for the threshold), then one pass that writes
the chosen positions in increasing order (ties at the threshold: lower positions first), then -1.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from openmla.device import INTERPRET
from openmla.ops._fp8 import to_e4m3
from openmla.ops._validate import FLOAT16_DTYPES, capturing, check_index, check_no_overlap, check_tensor, describe
from openmla.ops.cache import check_block_table

__all__ = [
    "concat_and_cache_indexer_k",
    "indexer_logits",
    "indexer_topk",
    "logits_topk",
    "quantize_indexer_q",
    "alloc_indexer_k_cache",
    "indexer_k_cache_views",
    "INDEXER_CACHE_DTYPES",
]

INDEXER_CACHE_DTYPES = ("auto", "fp8")
SCALE_FMTS = (None, "ue8m0")
FP8_SCALE_BYTES = 4  # one fp32 scale per token
_AUTO_DTYPES = FLOAT16_DTYPES + (torch.float32,)
_Q_DTYPES = _AUTO_DTYPES + (torch.float8_e4m3fn,)

# Scores pass tiling: keys per tile, keys per program (a multiple of the tile), warps, pipeline stages. Tests and the
# benchmark try others through the private ``_tiling=(block_n, split, num_warps, num_stages)`` argument.
_BLOCK_N = 64
_KEY_SPLIT = 1024
_NUM_WARPS = 4
_NUM_STAGES = 4  # offline sm90 compile: 3 key tiles in flight, 33 KB shared, 111 registers (4 programs an SM)
_PRELOAD_MAX_PAGES = 32  # block numbers a program loads up front when its tiles cross pages (a [tile, pages] pick)
_MAX_ROWS = 128  # query rows x heads per tl.dot (its N side)
_QUERY_SPLIT = 128  # query rows per program when max_query_len is given (prefill parallelism)
_WRITE_TOKENS = 16  # tokens per program of the cache writer
# Top-k pass: logits per chunk of the row scan (one program per row; a big chunk keeps 32 KB of loads in flight,
# the row's passes being sequential), warps per row program. Private ``_topk_tiling=(block, num_warps)`` overrides it.
_TOPK_BLOCK = 8192
_TOPK_WARPS = 16
_TOPK_BLOCK_INTERPRET = 64  # CPU: tiny rows
_TOPK_MIN_PART = 4096  # fewest scores a program of a split row scans (rows split only when there are few of them)
# topk_impl choices; "auto": the radix select below _TOPK_TORCH_MIN_ROWS rows, torch.topk's threshold from there on a
# GPU (H200, 32k scores a row: radix 114 us against 150 at 128 rows, 3637 against 3082 us at 4096 rows)
_TOPK_IMPLS = ("auto", "triton", "torch")
_TOPK_TORCH_MIN_ROWS = 1024
# TMA key tiles where the device has them (private ``_tma=False``: pointer loads); H200 decode b128 s32768 h64 fp8:
# 158 us (86% of the read bandwidth) against 176 us (77%), benchmarks/RESULTS.md "Lightning indexer"
_USE_TMA = True


def _int_tuple(name: str, value, n: int) -> tuple[int, ...]:
    """``value`` as a tuple of ``n`` positive ints, else a ValueError naming ``name``."""
    ok = isinstance(value, (tuple, list)) and len(value) == n
    if not ok or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(f"{name} must be {n} positive ints; got {value!r}")
    return tuple(value)


def _scores_tiling(tiling) -> tuple[int, int, int, int]:
    """(block_n, split, num_warps, num_stages): the module constants, or the private ``_tiling`` checked."""
    if tiling is None:
        return _BLOCK_N, _KEY_SPLIT, _NUM_WARPS, _NUM_STAGES
    block_n, split, warps, stages = _int_tuple("_tiling (block_n, split, num_warps, num_stages)", tiling, 4)
    if block_n < 16 or block_n & (block_n - 1) or split % block_n:
        raise ValueError(f"_tiling: block_n must be a power of two >= 16 dividing split; got {tiling!r}")
    return block_n, split, warps, stages


def _check_tma(tma) -> bool:
    if not isinstance(tma, bool):
        raise ValueError(f"_tma must be a bool; got {tma!r}")
    return tma


# ---------------------------------------------------------------------------------------------------------------
# Key cache writer


@triton.jit
def _quantize_rows(b_x, UE8M0: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """Per-row e4m3 of an fp32 [R, C] tile: (e4m3 [R, C], fp32 scale [R]), scale = max(amax, 1e-4) / 448 (rounded
    up to a power of two for UE8M0), divisions IEEE-rounded so that the bytes match the torch reference."""
    b_amax = tl.maximum(tl.max(tl.abs(b_x), axis=1), 1e-4)
    b_s = tl.math.div_rn(b_amax, tl.full(b_amax.shape, 448.0, dtype=tl.float32))
    if UE8M0:  # round up to a power of two: bump the exponent when any mantissa bit is set
        bits = b_s.to(tl.int32, bitcast=True)
        bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
        b_s = bits.to(tl.float32, bitcast=True)
    return to_e4m3(tl.math.div_rn(b_x, b_s[:, None] + tl.zeros_like(b_x)), EXACT_ROUND), b_s


@triton.jit
def _quantize_indexer_q_fwd_kernel(
    q,  # [T, H, D]
    q_fp8,  # [T, H, D] e4m3
    scale,  # [T, H] fp32
    stride_q_t,
    stride_q_h,
    H,
    R,  # T * H rows
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    o_d = tl.arange(0, BLOCK_D)
    m_x = m_r[:, None] & (o_d < D)[None, :]
    p_q = q + ((o_r // H) * stride_q_t + (o_r % H) * stride_q_h)[:, None] + o_d[None, :]
    b_q, b_s = _quantize_rows(tl.load(p_q, mask=m_x, other=0.0).to(tl.float32), UE8M0, EXACT_ROUND)
    tl.store(q_fp8 + o_r[:, None] * D + o_d[None, :], b_q, mask=m_x)
    tl.store(scale + o_r, b_s, mask=m_r)


def quantize_indexer_q(q: torch.Tensor, *, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    r"""Quantise indexer queries to e4m3 per (token, head), vLLM's fp8 indexer q (SPEC §6.1).

    Args:
        q (torch.Tensor): `[T, H_i, D_i]` bf16/fp16/fp32.
        scale_fmt (str | None): "ue8m0" (the default, V3.2: scales rounded up to a power of two) or None.

    Returns:
        (q_fp8, scale): `[T, H_i, D_i]` float8_e4m3fn (contiguous) and `[T, H_i]` fp32 with
        ``q ~= q_fp8 * scale[..., None]``, ``scale = max(amax, 1e-4) / 448``. Pass ``q_fp8`` to
        :func:`indexer_logits` / :func:`indexer_topk` with ``weights * scale`` (a positive scale commutes with
        the relu).
    """
    check_tensor("q", q, dtypes=_AUTO_DTYPES, ndim=3)
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f'scale_fmt must be None or "ue8m0"; got {scale_fmt!r}')
    T, H, D = q.shape
    q_fp8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=q.device)
    scale = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T * H:
        _quantize_indexer_q_fwd_kernel[(triton.cdiv(T * H, _WRITE_TOKENS),)](
            q, q_fp8, scale, q.stride(0), q.stride(1), H, T * H, D=D, BLOCK_D=triton.next_power_of_2(D),
            BLOCK_R=_WRITE_TOKENS, UE8M0=scale_fmt == "ue8m0", EXACT_ROUND=INTERPRET,
        )  # fmt: skip
    return q_fp8, scale


@triton.jit
def _concat_and_cache_indexer_k_fwd_kernel(
    k,  # [T, D]
    cache,  # auto: [num_blocks, block_size, D]; fp8: uint8 block-split (module docstring)
    cache_f32,  # fp8: the same memory viewed as fp32 (the scales)
    slot_mapping,  # [T]
    stride_k_t,
    stride_c_b,  # elements (bytes for fp8)
    stride_c_o,
    T,
    num_slots,
    block_size,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP8: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    slot = tl.load(slot_mapping + o_t, mask=m_t, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    i_blk = slot // block_size
    i_off = slot % block_size
    o_d = tl.arange(0, BLOCK_D)
    m_k = valid[:, None] & (o_d < D)[None, :]
    b_k = tl.load(k + o_t[:, None] * stride_k_t + o_d[None, :], mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_T, D]
    if FP8:
        b_q, b_s = _quantize_rows(b_k, UE8M0, EXACT_ROUND)
        b_q = b_q.to(tl.uint8, bitcast=True)
        base = i_blk * stride_c_b
        tl.store(cache + (base + i_off * D)[:, None] + o_d[None, :], b_q, mask=m_k)
        tl.store(cache_f32 + (base + block_size * D) // 4 + i_off, b_s, mask=valid)
    else:
        p_c = cache + (i_blk * stride_c_b + i_off * stride_c_o)[:, None] + o_d[None, :]
        tl.store(p_c, b_k.to(cache.dtype.element_ty), mask=m_k)


def _check_cache(name: str, cache, cache_dtype: str, head_dim: int | None = None) -> int:
    """Validate an indexer key cache for its layout; return the key width D."""
    if cache_dtype not in INDEXER_CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {INDEXER_CACHE_DTYPES}; got {cache_dtype!r}")
    check_tensor(name, cache, ndim=3)
    if cache_dtype == "auto":
        if cache.dtype not in _AUTO_DTYPES:
            raise TypeError(f'{name} must be bf16/fp16/fp32 for cache_dtype="auto"; got {describe(cache)}')
        D = cache.shape[-1]
    else:
        if cache.dtype != torch.uint8:
            raise TypeError(f'{name} must be uint8 [num_blocks, block_size, D + 4] for cache_dtype="fp8"; '
                            f"got {describe(cache)}")  # fmt: skip
        D = cache.shape[-1] - FP8_SCALE_BYTES
        if D < 4 or D % 4:
            raise ValueError(f"{name} rows must be D + 4 bytes with D a positive multiple of 4; got {describe(cache)}")
        if cache.stride(1) != cache.shape[-1] or cache.stride(0) % 4 or cache.storage_offset() % 4:
            raise ValueError(
                f"an fp8 {name} needs each block contiguous and 4-byte aligned (block-split layout); "
                f"got strides {cache.stride()}, storage offset {cache.storage_offset()}"
            )
    if head_dim is not None and D != head_dim:
        raise ValueError(f"{name} holds keys of width {D} but the input has width {head_dim}; got {describe(cache)}")
    return D


def _scale_view(cache, cache_dtype):
    return cache.view(torch.float32) if cache_dtype == "fp8" else cache


def concat_and_cache_indexer_k(
    k: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    cache_dtype: str = "auto",
    scale_fmt: str | None = None,
    validate: bool = True,
) -> None:
    r"""Write each token's indexer key into the paged indexer key cache, in place.

    Args:
        k (torch.Tensor): `[T, D]` (D = 128 for V3.2), bf16/fp16/fp32; the normed, RoPE'd indexer key.
        cache (torch.Tensor): `[num_blocks, block_size, D]` bf16/fp16/fp32 for "auto", or uint8
            `[num_blocks, block_size, D + 4]` in the block-split fp8 layout (module docstring) for "fp8";
            see :func:`alloc_indexer_k_cache`.
        slot_mapping (torch.Tensor): `[T]`, int32/int64; slot = block * block_size + offset; negative = skip.
        cache_dtype (str): "auto" or "fp8".
        scale_fmt (str | None): fp8 only: None (``max(amax, 1e-4) / 448``) or "ue8m0" (that, rounded up to a
            power of two; V3.2's choice).
        validate (bool): check that every slot lies inside the cache (a host synchronisation); without it a
            slot beyond the cache is skipped, never written.

    Raises:
        ValueError/TypeError: on a wrong shape, dtype, device or layout, or a slot beyond the cache.
    """
    check_tensor("k", k, dtypes=_AUTO_DTYPES, ndim=2)
    dev = k.device
    check_index("slot_mapping", slot_mapping, ndim=1, device=dev, length=k.shape[0])
    D = _check_cache("cache", cache, cache_dtype, head_dim=k.shape[1])
    if cache.device != dev:
        raise ValueError(f"cache must be on {dev} like k; got {describe(cache)}")
    check_no_overlap("cache", cache)  # written in place
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f'scale_fmt must be None or "ue8m0"; got {scale_fmt!r}')
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_slots = num_blocks * block_size
    T = k.shape[0]
    if T == 0:
        return
    if validate and not capturing():
        top = int(slot_mapping.max())
        if top >= num_slots:
            raise ValueError(f"slot_mapping holds slot {top} but cache has only {num_slots} slots")
    slot_mapping = slot_mapping.contiguous()  # the kernel reads one slot per token from a dense array
    _concat_and_cache_indexer_k_fwd_kernel[(triton.cdiv(T, _WRITE_TOKENS),)](
        k, cache, _scale_view(cache, cache_dtype), slot_mapping, k.stride(0), cache.stride(0), cache.stride(1),
        T, num_slots, block_size, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_T=_WRITE_TOKENS,
        FP8=cache_dtype == "fp8",
        UE8M0=scale_fmt == "ue8m0", EXACT_ROUND=INTERPRET,
    )  # fmt: skip


def alloc_indexer_k_cache(
    num_blocks: int,
    block_size: int,
    head_dim: int,
    *,
    cache_dtype: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A zeroed indexer key cache: `[num_blocks, block_size, head_dim]` of ``dtype`` for "auto", uint8
    `[num_blocks, block_size, head_dim + 4]` (block-split e4m3 keys + fp32 scales) for "fp8"."""
    if cache_dtype not in INDEXER_CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {INDEXER_CACHE_DTYPES}; got {cache_dtype!r}")
    if num_blocks < 0 or block_size < 1 or head_dim < 1:
        raise ValueError(f"need num_blocks >= 0, block_size >= 1, head_dim >= 1; got {num_blocks}, {block_size}, "
                         f"{head_dim}")  # fmt: skip
    if cache_dtype == "auto":
        if dtype not in _AUTO_DTYPES:
            raise TypeError(f"dtype must be bf16/fp16/fp32 for an auto indexer cache; got {dtype}")
        return torch.zeros(num_blocks, block_size, head_dim, dtype=dtype, device=device)
    if head_dim % 4:
        raise ValueError(f"an fp8 indexer cache needs head_dim to be a multiple of 4; got {head_dim}")
    return torch.zeros(num_blocks, block_size, head_dim + FP8_SCALE_BYTES, dtype=torch.uint8, device=device)


def indexer_k_cache_views(cache: torch.Tensor, *, cache_dtype: str = "auto"):
    """Zero-copy views of an indexer key cache: ``(keys, scales)``.

    "auto": ``(cache, None)``; "fp8": ``(e4m3 [num_blocks, block_size, D], fp32 [num_blocks, block_size])``,
    strided views into the block-split bytes (``key ~= keys.float() * scales[..., None]``).
    """
    D = _check_cache("cache", cache, cache_dtype)
    if cache_dtype == "auto":
        return cache, None
    NB, BS, W = cache.shape
    blocks = cache.as_strided((NB, BS * W), (cache.stride(0), 1))
    keys = blocks[:, : BS * D].unflatten(1, (BS, D)).view(torch.float8_e4m3fn)
    scales = blocks[:, BS * D :].view(torch.float32)
    return keys, scales


# ---------------------------------------------------------------------------------------------------------------
# Scores pass


@triton.jit
def _indexer_logits_fwd_kernel(
    q,  # [T, H, D]
    weights,  # [T, H] fp32
    k_cache,  # auto: [num_blocks, block_size, D]; fp8: uint8 block-split
    k_scale,  # fp8: the same memory as fp32 (per-token scales)
    k_desc,  # USE_TMA: a descriptor over the keys as [num_blocks, block_size, D], box [1, BLOCK_N, D]
    block_table,  # [B, max_blocks]
    seq_lens,  # [B]
    query_start_loc,  # [B + 1]
    out,  # [T, S] fp32
    row_len,  # [T] int32: keys row t sees, min(pos_t + 1, S); 0 outside every request
    stride_q_t,
    stride_q_h,
    stride_w_t,
    stride_c_b,  # elements (bytes for fp8)
    stride_c_o,
    stride_bt_b,
    stride_o_t,
    T,
    B,
    H,
    num_blocks,
    max_blocks,
    S,
    block_size,
    split_len,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    Q_PER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr,  # BLOCK_N divides block_size: no tile crosses a page
    PRELOAD: tl.constexpr,  # the split's block numbers loaded before the key loop (PAGE_ALIGNED or few pages)
    MAX_PAGES: tl.constexpr,
    USE_TMA: tl.constexpr,  # key tiles by TMA (PAGE_ALIGNED and D == BLOCK_D only)
    FILL: tl.constexpr,  # write -inf past the visible keys too (False: the top-k reads only row_len columns)
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = Q_PER * BLOCK_H
    i_b = tl.program_id(0)  # program B owns the rows after the last request (all -inf)
    i_s = tl.program_id(1)
    i_q = tl.program_id(2)
    n_q = tl.num_programs(2)
    is_req = i_b < B
    q_start = tl.load(query_start_loc + i_b)
    q_end = tl.load(query_start_loc + i_b + 1, mask=is_req, other=T)
    L = tl.load(seq_lens + i_b, mask=is_req, other=0)
    q_start = tl.minimum(tl.maximum(q_start, 0), T)  # rows stay inside [0, T) even unvalidated
    q_end = tl.minimum(tl.maximum(q_end, q_start), T)
    qlen = q_end - q_start
    chunk = tl.cdiv(tl.cdiv(qlen, n_q), Q_PER) * Q_PER
    j_lo = i_q * chunk
    j_hi = tl.minimum(j_lo + chunk, qlen)
    n_lo = i_s * split_len
    n_hi = tl.minimum(n_lo + split_len, S)
    if (j_lo >= j_hi) | (n_lo >= n_hi):
        return

    o_m = tl.arange(0, BLOCK_M)
    o_mj = o_m // BLOCK_H  # query row of each dot column
    o_mh = o_m % BLOCK_H  # head of each dot column
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_j = tl.arange(0, Q_PER)
    o_n0 = tl.arange(0, BLOCK_N)
    p_bt = block_table + i_b.to(tl.int64) * stride_bt_b
    if PRELOAD:
        # the split's block numbers are loaded before the key loop (a block-table load inside the loop kept the
        # pipeline one tile deep): one per tile when no tile crosses a page, else picked per key row
        o_pg = tl.arange(0, MAX_PAGES)
        i_pg0 = n_lo // block_size
        m_pg = (i_pg0 + o_pg < max_blocks) & ((i_pg0 + o_pg) * block_size < tl.minimum(n_hi, L))
        b_pages = tl.load(p_bt + i_pg0 + o_pg, mask=m_pg, other=-1).to(tl.int64)
    for j0 in range(j_lo, j_hi, Q_PER):
        t_m = (q_start + j0 + o_mj).to(tl.int64)
        m_m = (j0 + o_mj < j_hi) & (o_mh < H)
        p_q = q + t_m[:, None] * stride_q_t + o_mh[:, None] * stride_q_h + o_d[None, :]
        b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(COMPUTE)  # [M, BLOCK_D]
        b_w = tl.load(weights + t_m * stride_w_t + o_mh, mask=m_m, other=0.0)  # [M]
        o_t = j0 + o_j
        m_t = o_t < j_hi
        pos = L - qlen + o_t  # [Q_PER] causal limit of each row
        p_out = out + (q_start + o_t).to(tl.int64) * stride_o_t  # [Q_PER]
        if i_s == 0:
            tl.store(row_len + q_start + o_t, tl.minimum(tl.maximum(pos + 1, 0), S), mask=m_t)
        # keys [n_lo, vis_hi) are seen by some row of this chunk; later tiles are all -inf
        vis_hi = tl.minimum(tl.minimum(L - qlen + tl.minimum(j0 + Q_PER, j_hi), L), n_hi)
        n_mid = n_lo + tl.cdiv(tl.maximum(vis_hi - n_lo, 0), BLOCK_N) * BLOCK_N
        for n0 in range(n_lo, n_mid, BLOCK_N):
            o_n = n0 + o_n0
            off = o_n % block_size
            if PAGE_ALIGNED:
                blk = tl.sum(tl.where(o_pg == n0 // block_size - i_pg0, b_pages, 0))
                ok = (blk >= 0) & (blk < num_blocks)  # an unchecked bad block scores -inf, never read
                m_n = (o_n < vis_hi) & ok
                base = tl.where(ok, blk * stride_c_b, 0) + tl.zeros_like(o_n).to(tl.int64)
            elif PRELOAD:
                m_pg_n = o_pg[None, :] == (o_n // block_size - i_pg0)[:, None]  # [BLOCK_N, MAX_PAGES]
                blk = tl.sum(tl.where(m_pg_n, b_pages[None, :], 0), axis=1)
                m_n = (o_n < vis_hi) & (blk >= 0) & (blk < num_blocks)  # an unchecked bad block scores -inf
                base = tl.where(m_n, blk * stride_c_b, 0)
            else:
                i_pg = o_n // block_size
                m_n = (o_n < vis_hi) & (i_pg < max_blocks)
                blk = tl.load(p_bt + i_pg, mask=m_n, other=-1).to(tl.int64)
                m_n = m_n & (blk >= 0) & (blk < num_blocks)  # an unchecked bad block scores -inf, never read
                base = tl.where(m_n, blk * stride_c_b, 0)
            if USE_TMA:
                # a whole page-internal tile; an invalid block number points past the cache, where TMA reads zeros.
                # Rows past the visible keys may hold anything (even NaN): their scores are masked below.
                i_row = tl.where(ok, blk, num_blocks).to(tl.int32)
                b_k = tl.reshape(k_desc.load([i_row, (n0 % block_size).to(tl.int32), 0]), (BLOCK_N, BLOCK_D))
                if FP8:
                    b_k = b_k.to(tl.float8e4nv, bitcast=True)
                    b_sk = tl.load(k_scale + (base + block_size * D) // 4 + off, mask=m_n, other=0.0)
                b_k = b_k.to(COMPUTE)
            elif FP8:
                p_k = k_cache + base[:, None] + (off * D)[:, None] + o_d[None, :]
                b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0)
                b_k = b_k.to(tl.float8e4nv, bitcast=True).to(COMPUTE)
                b_sk = tl.load(k_scale + (base + block_size * D) // 4 + off, mask=m_n, other=0.0)
            else:
                p_k = k_cache + base[:, None] + (off * stride_c_o)[:, None] + o_d[None, :]
                b_k = tl.load(p_k, mask=m_n[:, None] & m_d[None, :], other=0.0).to(COMPUTE)
            b_s = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION)  # [N, M] keys x (rows, heads)
            b_s = tl.maximum(b_s, 0.0) * b_w[None, :]
            if Q_PER == 1:
                b_l = tl.sum(b_s, axis=1)[:, None]
            else:
                b_l = tl.sum(tl.reshape(b_s, (BLOCK_N, Q_PER, BLOCK_H)), axis=2)  # [N, Q_PER]
            if FP8:
                b_l = b_l * b_sk[:, None]  # the key's scale is positive: it commutes with the relu
            b_l = tl.where(m_n[:, None] & (o_n[:, None] <= pos[None, :]), b_l, float("-inf"))
            tl.store(p_out[None, :] + o_n[:, None], b_l, mask=m_t[None, :] & (o_n < n_hi)[:, None])
        if FILL:
            b_inf = tl.full([BLOCK_N, Q_PER], float("-inf"), dtype=tl.float32)
            for n0 in range(n_mid, n_hi, BLOCK_N):
                o_n = n0 + o_n0
                tl.store(p_out[None, :] + o_n[:, None], b_inf, mask=m_t[None, :] & (o_n < n_hi)[:, None])


def _compute(q_dtype, cache_dtype_t):
    """(Triton operand dtype, dot precision): fp32 under the interpreter (bf16 is raw bits there) or with an fp32
    input; e4m3 x e4m3 for an fp8 q; else q's 16-bit dtype (an fp8 key is widened to it)."""
    if INTERPRET or q_dtype == torch.float32 or cache_dtype_t == torch.float32:
        return tl.float32, "ieee"
    if q_dtype == torch.float8_e4m3fn:
        return tl.float8e4nv, None
    return (tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16), None


def _check_scores_args(q, weights, k_cache, block_table, seq_lens, query_start_loc, cache_dtype, max_seq_len,
                       max_query_len):  # fmt: skip
    check_tensor("q", q, dtypes=_Q_DTYPES, ndim=3)
    T, H, D = q.shape
    dev = q.device
    check_tensor("weights", weights, dtypes=(torch.float32,), shape=(T, H), device=dev)
    _check_cache("k_cache", k_cache, cache_dtype, head_dim=D)
    if k_cache.device != dev:
        raise ValueError(f"k_cache must be on {dev} like q; got {describe(k_cache)}")
    if q.dtype == torch.float8_e4m3fn and cache_dtype != "fp8":
        raise TypeError(f'an fp8 q needs cache_dtype="fp8" (e4m3 x e4m3 products); got q {describe(q)}')
    check_index("block_table", block_table, ndim=2, device=dev)
    B = block_table.shape[0]
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    check_index("query_start_loc", query_start_loc, ndim=1, device=dev, length=B + 1)
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dimension; got strides {block_table.stride()}")
    S = block_table.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len
    if isinstance(S, bool) or not isinstance(S, int) or S < 0:  # (a bool is an int to Python, not a width)
        raise ValueError(f"max_seq_len must be a non-negative int; got {max_seq_len!r}")
    if max_query_len is not None and (
        isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1
    ):
        raise ValueError(f"max_query_len must be a positive int or None; got {max_query_len!r}")
    return T, H, D, B, S


def _validate_batch(T, B, S, k_cache, block_table, seq_lens, query_start_loc):
    """Host-synchronising checks of the batch description (validate=True, outside graph capture)."""
    if B == 0:
        if int(query_start_loc[0]) > T:
            raise ValueError(f"query_start_loc[0] is {int(query_start_loc[0])} but q has {T} rows")
        return
    qsl = query_start_loc.long()
    qlen = qsl[1:] - qsl[:-1]
    if int(qsl[0]) < 0 or int(qlen.min()) < 0 or int(qsl[-1]) > T:
        raise ValueError(f"query_start_loc must be non-decreasing from >= 0 up to at most T = {T}; "
                         f"got {query_start_loc.tolist()[:8]}...")  # fmt: skip
    if int((seq_lens.long() - qlen).min()) < 0:
        raise ValueError("every request needs seq_lens >= its query length (context + new tokens)")
    if int(seq_lens.max()) > S:
        raise ValueError(f"a request holds {int(seq_lens.max())} keys but max_seq_len is {S}")
    check_block_table(block_table, seq_lens, None, k_cache.shape[1], k_cache.shape[0])


def _tma_wanted(k_cache, tma: bool) -> bool:
    """TMA key tiles when asked for (``_tma``, default _USE_TMA) and the device has them (sm90+; the interpreter
    runs them too)."""
    if not tma:
        return False
    return k_cache.device.type != "cuda" or torch.cuda.get_device_capability(k_cache.device) >= (9, 0)


def _key_descriptor(k_cache, cache_dtype, D, block_n):
    """A TMA descriptor over the keys as [num_blocks, block_size, D] (the fp8 block-split bytes or the auto rows),
    box [1, block_n, D]; None where TMA cannot address them (strides and the base 16-byte aligned, D a power of
    two of 32 to 256 elements)."""
    es = k_cache.element_size()
    row = D if cache_dtype == "fp8" else k_cache.stride(1)
    if D & (D - 1) or D < 32 or D > 256 or block_n > 256:  # the box is the whole key (BLOCK_D == D)
        return None
    if (k_cache.stride(0) * es) % 16 or (row * es) % 16 or k_cache.data_ptr() % 16:
        return None
    NB, BS = k_cache.shape[:2]
    return TensorDescriptor(k_cache, [NB, BS, D], [k_cache.stride(0), row, 1], [1, block_n, D])


def _indexer_logits_fwd(q, weights, k_cache, block_table, seq_lens, query_start_loc, cache_dtype, S,
                        max_query_len, out, row_len, tiling, tma, fill=True):  # fmt: skip
    """The scores pass; ``tiling`` a checked (block_n, split, num_warps, num_stages), ``tma`` a bool."""
    T, H, D = q.shape
    B = block_table.shape[0]
    block_n, split, warps, stages = tiling
    BLOCK_H = max(16, triton.next_power_of_2(H))
    q_per = 1
    if max_query_len is not None and BLOCK_H < _MAX_ROWS:
        q_per = min(triton.next_power_of_2(max_query_len), _MAX_ROWS // BLOCK_H)
    n_q = 1 if max_query_len is None else triton.cdiv(max_query_len, _QUERY_SPLIT)
    compute, precision = _compute(q.dtype, k_cache.dtype)
    block_size = k_cache.shape[1]
    aligned = block_size % block_n == 0
    pages = split // block_size if split % block_size == 0 else triton.cdiv(split, block_size) + 1
    preload = aligned or triton.next_power_of_2(pages) <= _PRELOAD_MAX_PAGES
    k_desc = _key_descriptor(k_cache, cache_dtype, D, block_n) if aligned and _tma_wanted(k_cache, tma) else None
    grid = (B + 1, triton.cdiv(S, split), n_q)
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()  # the kernel reads dense arrays
    _indexer_logits_fwd_kernel[grid](
        q, weights, k_cache, _scale_view(k_cache, cache_dtype), k_desc, block_table, seq_lens, query_start_loc, out,
        row_len,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), T, B, H, k_cache.shape[0], block_table.shape[1], S, k_cache.shape[1], split,
        D=D, BLOCK_D=max(32, triton.next_power_of_2(D)), BLOCK_H=BLOCK_H, Q_PER=q_per, BLOCK_N=block_n,
        FP8=cache_dtype == "fp8", PAGE_ALIGNED=aligned, PRELOAD=preload, MAX_PAGES=triton.next_power_of_2(pages),
        USE_TMA=k_desc is not None, FILL=fill, COMPUTE=compute, DOT_PRECISION=precision, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    cache_dtype: str = "auto",
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    _tiling: tuple[int, int, int, int] | None = None,
    _tma: bool = _USE_TMA,
) -> torch.Tensor:
    r"""Lightning-indexer scores of every query row against its request's causal keys.

    ``out[t, p] = sum_h relu(q[t, h] . k[p]) * weights[t, h]`` for ``p <= pos_t = seq_len - qlen + j`` (row t
    the j-th query row of its request), ``-inf`` for later positions, positions ``>= seq_len`` and rows outside
    every request. ``k[p]`` is the dequantised key (e4m3 times its scale for "fp8").

    Args:
        q (torch.Tensor): `[T, H_i, D_i]` (64 x 128 for V3.2), bf16/fp16/fp32, or float8_e4m3fn with an fp8
            cache (products in e4m3, accumulated in fp32; fold q's per-head scale into ``weights``).
        weights (torch.Tensor): `[T, H_i]` fp32; every scale (``D_i^-0.5 * H_i^-0.5``, q's) folded in.
        k_cache (torch.Tensor): the indexer key cache of ``cache_dtype`` (module docstring); any block size.
        block_table (torch.Tensor): `[B, max_blocks]` int32/int64.
        seq_lens (torch.Tensor): `[B]` int32/int64; keys per request (context + new tokens).
        query_start_loc (torch.Tensor): `[B + 1]` int32/int64; request b owns rows
            ``query_start_loc[b]:query_start_loc[b+1]``.
        cache_dtype (str): "auto" or "fp8".
        max_seq_len (int | None): columns of the output; default ``max_blocks * block_size`` (no host sync).
        max_query_len (int | None): a hint for prefill: with it the longest request's rows are spread over
            ``ceil(max_query_len / 128)`` programs per key split (results do not depend on it). Leave None
            for decode (every row of a request in one program: the cache is read once).
        out (torch.Tensor | None): `[T, max_seq_len]` fp32 to write into (CUDA-graph buffers).
        validate (bool): check the batch (query_start_loc, seq_lens <= max_seq_len, the block table) with a
            host synchronisation. Unchecked bad blocks score -inf and are never read.
        _tiling, _tma: private, for tests and the benchmark (docs/indexer.md): a scores tiling
            ``(block_n, split, num_warps, num_stages)`` instead of the module constants; TMA key tiles.

    Returns:
        torch.Tensor: `[T, max_seq_len]` fp32.
    """
    T, H, D, B, S = _check_scores_args(q, weights, k_cache, block_table, seq_lens, query_start_loc, cache_dtype,
                                       max_seq_len, max_query_len)  # fmt: skip
    tiling, tma = _scores_tiling(_tiling), _check_tma(_tma)
    if out is None:
        out = torch.empty(T, S, dtype=torch.float32, device=q.device)
    else:
        check_tensor("out", out, dtypes=(torch.float32,), shape=(T, S), device=q.device)
        check_no_overlap("out", out)
    if validate and not capturing():
        _validate_batch(T, B, S, k_cache, block_table, seq_lens, query_start_loc)
    if T == 0 or S == 0:
        return out
    row_len = torch.empty(T, dtype=torch.int32, device=q.device)
    _indexer_logits_fwd(q, weights, k_cache, block_table, seq_lens, query_start_loc, cache_dtype, S, max_query_len,
                        out, row_len, tiling, tma)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------------
# Top-k pass


@triton.jit
def _order_key(x):
    """fp32 -> uint32 of the same order (-0.0 folded onto +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _radix_pick(b_hist, k_rem, prefix, hi_mask, SHIFT: tl.constexpr):
    """One radix step: the bin (8 bits at SHIFT) holding the k_rem-th largest of the keys counted in b_hist [256];
    returns k_rem within that bin and the prefix / mask extended by it."""
    o_bin = tl.arange(0, 256)
    b_incl = tl.sum(b_hist, axis=0) - tl.cumsum(b_hist, axis=0) + b_hist  # keys in bins >= each bin
    i_bin = tl.max(tl.where(b_incl >= k_rem, o_bin, 0), axis=0)
    k_rem = k_rem - tl.sum(tl.where(o_bin > i_bin, b_hist, 0), axis=0)
    prefix = prefix | (i_bin.to(tl.uint32) << SHIFT)
    hi_mask = hi_mask | (tl.full([], 0xFF, tl.uint32) << SHIFT)
    return k_rem, prefix, hi_mask


@triton.jit
def _radix_threshold(p_hist, K, PASSES: tl.constexpr):
    """From a row's histograms ``p_hist`` [4, 256] (the first PASSES filled): (prefix, mask, keys of the prefix to
    keep, valid keys in the row)."""
    o_bin = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.uint32)
    hi_mask = tl.zeros([], dtype=tl.uint32)
    k_rem = K
    n_valid = tl.sum(tl.load(p_hist + o_bin), axis=0)
    for i_pass in tl.static_range(PASSES):
        k_rem, prefix, hi_mask = _radix_pick(tl.load(p_hist + i_pass * 256 + o_bin), k_rem, prefix, hi_mask,
                                             24 - 8 * i_pass)  # fmt: skip
    return prefix, hi_mask, k_rem, n_valid


@triton.jit
def _emit_range(p_row, p_out, lo, hi, thr_key, n_eq, n_out, n_eq_seen, K, BLOCK: tl.constexpr):
    """Write the positions in [lo, hi) of the keys above ``thr_key`` and of those equal to it whose rank among the
    equal ones (``n_eq_seen`` of them before ``lo``) is at most ``n_eq``, in position order from slot ``n_out``;
    returns the next slot."""
    o_c = tl.arange(0, BLOCK)
    for c0 in range(lo, hi, BLOCK):
        o = c0 + o_c
        b_x = tl.load(p_row + o, mask=o < hi, other=float("-inf"))
        b_key = _order_key(b_x)
        m_ok = b_x > float("-inf")
        m_gt = m_ok & (b_key > thr_key)
        m_eq = m_ok & (b_key == thr_key)
        b_eq_rank = n_eq_seen + tl.cumsum(m_eq.to(tl.int32), axis=0)
        m_take = m_gt | (m_eq & (b_eq_rank <= n_eq))
        b_off = n_out + tl.cumsum(m_take.to(tl.int32), axis=0) - 1
        tl.store(p_out + b_off, o, mask=m_take & (b_off < K))
        n_out += tl.sum(m_take.to(tl.int32), axis=0)
        n_eq_seen += tl.sum(m_eq.to(tl.int32), axis=0)
    return n_out


@triton.jit
def _pad_row(p_out, start, K, BLOCK: tl.constexpr):
    """-1 in slots [start, K) of a top-k row."""
    o_c = tl.arange(0, BLOCK)
    for c0 in range(start, K, BLOCK):
        o = c0 + o_c
        tl.store(p_out + o, tl.full([BLOCK], -1, dtype=tl.int32), mask=o < K)


@triton.jit
def _topk_split_hist_kernel(
    logits,  # [T, S] fp32
    row_len,  # [T] int32 (HAS_LEN)
    hist,  # [T, 4, 256] int32, zeroed: the radix histograms of each row
    stride_l_t,
    S,
    K,
    chunk,  # scores per program (a multiple of BLOCK)
    PASS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
):
    """Radix pass PASS of a row split over programs: program (row, part) adds the histogram of its part's keys that
    match the prefix fixed by the earlier passes (integer atomics: the totals do not depend on the order)."""
    i_t = tl.program_id(0).to(tl.int64)
    n = S
    if HAS_LEN:
        n = tl.minimum(tl.maximum(tl.load(row_len + i_t), 0), S)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, n)
    p_hist = hist + i_t * 1024
    prefix, hi_mask, k_rem, n_valid = _radix_threshold(p_hist, K, PASS)
    if PASS > 0:
        hi = tl.where(n_valid > K, hi, lo)  # at most K valid keys: all are taken, no more passes
    p_row = logits + i_t * stride_l_t
    o_c = tl.arange(0, BLOCK)
    b_hist = tl.zeros([256], dtype=tl.int32)
    for c0 in range(lo, hi, BLOCK):
        o = c0 + o_c
        b_x = tl.load(p_row + o, mask=o < hi, other=float("-inf"))
        b_key = _order_key(b_x)
        m = (b_x > float("-inf")) & ((b_key & hi_mask) == prefix)
        b_hist += tl.histogram(((b_key >> (24 - 8 * PASS)) & 0xFF).to(tl.int32), 256, mask=m)
    o_bin = tl.arange(0, 256)
    tl.atomic_add(p_hist + PASS * 256 + o_bin, b_hist, mask=b_hist > 0)


@triton.jit
def _split_threshold(p_hist, thr, i_t, K, RADIX: tl.constexpr):
    """(threshold key, ties to keep or -1 when the counts decide it) of row i_t."""
    if RADIX:
        prefix, hi_mask, k_rem, n_valid = _radix_threshold(p_hist, K, 4)
        take_all = n_valid <= K
        thr_key = tl.where(take_all, tl.zeros([], dtype=tl.uint32), prefix)
        n_eq = tl.where(take_all, K, k_rem)
    else:
        thr_key = _order_key(tl.load(thr + i_t))
        n_eq = -1
    return thr_key, n_eq


@triton.jit
def _topk_split_emit_kernel(
    logits,  # [T, S] fp32
    row_len,  # [T] int32 (HAS_LEN)
    hist,  # [T, 4, 256] int32 (RADIX)
    thr,  # [T] fp32 (not RADIX): the k-th largest score
    counts,  # [T, P, 2] int32: keys above and at the threshold in each part
    out,  # [T, K] int32
    stride_l_t,
    stride_o_t,
    S,
    K,
    chunk,
    P,
    COUNT: tl.constexpr,  # True: count the part's keys into counts; False: write its chosen positions
    MAX_P: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    RADIX: tl.constexpr,
):
    """The final pass of a row split over programs: first each part counts its keys above / at the threshold, then
    each part writes its chosen positions at the offset the earlier parts' counts give (the same order as one
    program scanning the row), and the last part pads with -1."""
    i_t = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    n = S
    if HAS_LEN:
        n = tl.minimum(tl.maximum(tl.load(row_len + i_t), 0), S)
    lo = i_p * chunk
    hi = tl.minimum(lo + chunk, n)
    thr_key, n_eq = _split_threshold(hist + i_t * 1024, thr, i_t, K, RADIX)
    p_row = logits + i_t * stride_l_t
    p_cnt = counts + i_t * P * 2
    o_c = tl.arange(0, BLOCK)
    if COUNT:
        n_gt = 0
        n_at = 0
        for c0 in range(lo, hi, BLOCK):
            o = c0 + o_c
            b_x = tl.load(p_row + o, mask=o < hi, other=float("-inf"))
            b_key = _order_key(b_x)
            m_ok = b_x > float("-inf")
            n_gt += tl.sum((m_ok & (b_key > thr_key)).to(tl.int32), axis=0)
            n_at += tl.sum((m_ok & (b_key == thr_key)).to(tl.int32), axis=0)
        tl.store(p_cnt + i_p * 2, n_gt)
        tl.store(p_cnt + i_p * 2 + 1, n_at)
    else:
        o_p = tl.arange(0, MAX_P)
        m_p = o_p < P
        c_gt = tl.load(p_cnt + o_p * 2, mask=m_p, other=0)
        c_eq = tl.load(p_cnt + o_p * 2 + 1, mask=m_p, other=0)
        if not RADIX:
            n_eq = K - tl.sum(c_gt, axis=0)
        eq_before = tl.cumsum(c_eq, axis=0) - c_eq
        c_take = c_gt + tl.minimum(tl.maximum(n_eq - eq_before, 0), c_eq)
        n_out = tl.sum(tl.where(o_p < i_p, c_take, 0), axis=0)
        n_eq_seen = tl.sum(tl.where(o_p < i_p, c_eq, 0), axis=0)
        p_out = out + i_t * stride_o_t
        _emit_range(p_row, p_out, lo, hi, thr_key, n_eq, n_out, n_eq_seen, K, BLOCK)
        if i_p == P - 1:
            _pad_row(p_out, tl.minimum(tl.sum(c_take, axis=0), K), K, BLOCK)


@triton.jit
def _indexer_topk_fwd_kernel(
    logits,  # [T, S] fp32
    row_len,  # [T] int32: entries of the row to scan (HAS_LEN)
    thr,  # [T] fp32: the k-th largest score (not RADIX), -inf where the row has fewer than K
    out,  # [T, K] int32
    stride_l_t,
    stride_o_t,
    S,
    K,
    BLOCK: tl.constexpr,
    HAS_LEN: tl.constexpr,
    RADIX: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    n = S
    if HAS_LEN:
        n = tl.minimum(tl.maximum(tl.load(row_len + i_t), 0), S)
    p_row = logits + i_t * stride_l_t
    p_out = out + i_t * stride_o_t
    o_c = tl.arange(0, BLOCK)
    if RADIX:
        # the K-th largest key, 8 bits a pass from the top; k_rem = how many of the current prefix to keep
        prefix = tl.zeros([], dtype=tl.uint32)
        hi_mask = tl.zeros([], dtype=tl.uint32)
        k_rem = K
        n_valid = 0
        n_scan = n
        for i_pass in tl.static_range(4):
            b_hist = tl.zeros([256], dtype=tl.int32)
            for c0 in range(0, n_scan, BLOCK):
                o = c0 + o_c
                b_x = tl.load(p_row + o, mask=o < n, other=float("-inf"))
                b_key = _order_key(b_x)
                m = (b_x > float("-inf")) & ((b_key & hi_mask) == prefix)  # NaN and -inf never count
                b_hist += tl.histogram(((b_key >> (24 - 8 * i_pass)) & 0xFF).to(tl.int32), 256, mask=m)
            if i_pass == 0:
                n_valid = tl.sum(b_hist, axis=0)
                n_scan = tl.where(n_valid > K, n, 0)  # at most K valid: take them all, skip the other passes
            k_rem, prefix, hi_mask = _radix_pick(b_hist, k_rem, prefix, hi_mask, 24 - 8 * i_pass)
        take_all = n_valid <= K
        thr_key = tl.where(take_all, tl.zeros([], dtype=tl.uint32), prefix)
        n_eq = tl.where(take_all, K, k_rem)
    else:
        thr_key = _order_key(tl.load(thr + i_t))
        n_gt = 0
        for c0 in range(0, n, BLOCK):
            o = c0 + o_c
            b_x = tl.load(p_row + o, mask=o < n, other=float("-inf"))
            n_gt += tl.sum(((b_x > float("-inf")) & (_order_key(b_x) > thr_key)).to(tl.int32), axis=0)
        n_eq = K - n_gt
    zero = tl.zeros([], dtype=tl.int32)
    n_out = _emit_range(p_row, p_out, 0, n, thr_key, n_eq, zero, zero, K, BLOCK)
    _pad_row(p_out, tl.minimum(n_out, K), K, BLOCK)


def _check_topk_tiling(tiling) -> tuple[int, int]:
    """(block, num_warps): the module constants, or the private ``_topk_tiling`` checked."""
    if tiling is None:
        return (_TOPK_BLOCK_INTERPRET if INTERPRET else _TOPK_BLOCK), _TOPK_WARPS
    block, warps = _int_tuple("_topk_tiling (block, num_warps)", tiling, 2)
    if block < 16 or block & (block - 1):
        raise ValueError(f"_topk_tiling: block must be a power of two >= 16; got {tiling!r}")
    return block, warps


def _check_topk_split(split) -> int | None:
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
        raise ValueError(f"_topk_split must be a positive int or None; got {split!r}")
    return split


def _topk_fwd(logits, row_len, topk, out, impl, tiling, split):
    """The top-k pass; ``tiling`` a checked (block, num_warps), ``split`` None (by the row count) or parts."""
    T, S = logits.shape
    block, warps = tiling
    radix = impl == "triton"
    if radix:
        thr = logits
    elif topk >= S:  # every valid key is kept
        thr = torch.full((T,), float("-inf"), dtype=torch.float32, device=logits.device)
    else:
        finite = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"))  # torch.topk ranks NaN first
        thr = torch.topk(finite, topk, dim=1, sorted=False).values.amin(dim=1)
    lens = row_len if row_len is not None else logits
    parts = _topk_parts(T, S, block, logits.device, split)
    if parts == 1:
        _indexer_topk_fwd_kernel[(T,)](
            logits, lens, thr, out, logits.stride(0), out.stride(0), S, topk,
            BLOCK=block, HAS_LEN=row_len is not None, RADIX=radix, num_warps=warps,
        )  # fmt: skip
        return out
    # few rows: each row split over `parts` programs (radix passes, then counts, then positions)
    chunk = triton.cdiv(triton.cdiv(S, parts), block) * block
    parts = triton.cdiv(S, chunk)
    hist = torch.zeros(T, 4, 256, dtype=torch.int32, device=logits.device) if radix else lens
    counts = torch.empty(T, parts, 2, dtype=torch.int32, device=logits.device)
    grid = (T, parts)
    if radix:
        for i_pass in range(4):
            _topk_split_hist_kernel[grid](logits, lens, hist, logits.stride(0), S, topk, chunk, PASS=i_pass,
                                          BLOCK=block, HAS_LEN=row_len is not None, num_warps=warps)  # fmt: skip
    for count in (True, False):
        _topk_split_emit_kernel[grid](
            logits, lens, hist, thr, counts, out, logits.stride(0), out.stride(0), S, topk, chunk, parts,
            COUNT=count, MAX_P=triton.next_power_of_2(parts), BLOCK=block, HAS_LEN=row_len is not None, RADIX=radix,
            num_warps=warps,
        )  # fmt: skip
    return out


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _topk_parts(T: int, S: int, block: int, dev, split: int | None = None) -> int:
    """Programs a row's top-k is split over: 1 when the rows fill about half the SMs or more (one program a row),
    else enough for about two programs an SM, each at least _TOPK_MIN_PART scores (a split row costs 6 launches
    instead of 1). ``split`` (the private ``_topk_split``) forces it, at most one program a block of scores."""
    if split is not None:
        return max(1, min(split, triton.cdiv(S, block)))
    if dev.type != "cuda":
        return 1
    sms = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())
    if 2 * T >= sms:  # e.g. decode batch 128 on 132 SMs: one 16-warp program a row, one wave
        return 1
    return max(1, min(triton.cdiv(2 * sms, T), triton.cdiv(S, _TOPK_MIN_PART)))


def _pick_topk_impl(impl: str, T: int, device_type: str) -> str:
    """ "auto" -> "torch" from _TOPK_TORCH_MIN_ROWS rows on a GPU, else "triton"; the others as they are."""
    if impl != "auto":
        return impl
    return "torch" if device_type == "cuda" and T >= _TOPK_TORCH_MIN_ROWS else "triton"


def _check_topk(topk, impl, out, T, dev):
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int; got {topk!r}")
    if impl not in _TOPK_IMPLS:
        raise ValueError(f"topk_impl must be one of {_TOPK_IMPLS}; got {impl!r}")
    impl = _pick_topk_impl(impl, T, dev.type)
    if out is None:
        out = torch.empty(T, topk, dtype=torch.int32, device=dev)
    else:
        check_tensor("out", out, dtypes=(torch.int32,), shape=(T, topk), device=dev)
        check_no_overlap("out", out)
    return impl, out


def logits_topk(
    logits: torch.Tensor,
    topk: int,
    *,
    out: torch.Tensor | None = None,
    topk_impl: str = "auto",
    _topk_tiling: tuple[int, int] | None = None,
    _topk_split: int | None = None,
) -> torch.Tensor:
    """Per row, the positions of the ``topk`` largest scores of ``logits`` `[T, S]` fp32 (-inf and NaN never
    chosen), in increasing position order (ties at the threshold: lower positions first), then -1:
    int32 `[T, topk]`. ``topk_impl``: "triton" (radix select), "torch" (``torch.topk`` for the threshold; the
    same result) or "auto" (the default: "torch" from 1024 rows on a GPU, else "triton"). Private, for tests and
    the benchmark: ``_topk_tiling=(block, num_warps)`` instead of the module constants, ``_topk_split=parts`` a row
    split over that many programs (1: never) instead of by the row count."""
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    impl, out = _check_topk(topk, topk_impl, out, logits.shape[0], logits.device)
    tiling, split = _check_topk_tiling(_topk_tiling), _check_topk_split(_topk_split)
    if logits.shape[0]:
        if logits.shape[1] == 0:
            out.fill_(-1)
        else:
            _topk_fwd(logits, None, topk, out, impl, tiling, split)
    return out


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    topk: int,
    *,
    cache_dtype: str = "auto",
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    topk_impl: str = "auto",
    validate: bool = True,
    _tiling: tuple[int, int, int, int] | None = None,
    _tma: bool = _USE_TMA,
    _topk_tiling: tuple[int, int] | None = None,
    _topk_split: int | None = None,
) -> torch.Tensor:
    r"""The lightning indexer's causal top-k: per query row the request-local positions of its ``topk``
    best keys under :func:`indexer_logits`' scores.

    Row t holds its chosen positions in increasing order (a valid prefix; ties at the k-th score go to lower
    positions), then -1: ``min(topk, pos_t + 1)`` valid entries, exactly ``0 .. pos_t`` when
    ``pos_t + 1 <= topk``; rows outside every request are all -1. Arguments as :func:`indexer_logits`, plus:

    Args:
        topk (int): entries per row (2048 for V3.2).
        out (torch.Tensor | None): `[T, topk]` int32 to write into (e.g. the engine's shared buffer).
        topk_impl (str): "triton" (a radix select per row), "torch" (``torch.topk`` finds each row's threshold;
            the same result) or "auto" (the default: "torch" from 1024 rows on a GPU, where it measures faster,
            else "triton").
        _tiling, _tma, _topk_tiling, _topk_split: private, for tests and the benchmark: those of
            :func:`indexer_logits` and :func:`logits_topk`.

    Returns:
        torch.Tensor: `[T, topk]` int32. (The scores are an internal fp32 `[T, max_seq_len]` buffer.)
    """
    T, H, D, B, S = _check_scores_args(q, weights, k_cache, block_table, seq_lens, query_start_loc, cache_dtype,
                                       max_seq_len, max_query_len)  # fmt: skip
    impl, out = _check_topk(topk, topk_impl, out, T, q.device)
    tiling, tma = _scores_tiling(_tiling), _check_tma(_tma)
    topk_tiling, split = _check_topk_tiling(_topk_tiling), _check_topk_split(_topk_split)
    if validate and not capturing():
        _validate_batch(T, B, S, k_cache, block_table, seq_lens, query_start_loc)
    if T == 0:
        return out
    if S == 0:
        return out.fill_(-1)
    logits = torch.empty(T, S, dtype=torch.float32, device=q.device)
    row_len = torch.empty(T, dtype=torch.int32, device=q.device)
    # the top-k scans each row's first row_len columns only: the kernel skips the -inf fill past them
    _indexer_logits_fwd(q, weights, k_cache, block_table, seq_lens, query_start_loc, cache_dtype, S, max_query_len,
                        logits, row_len, tiling, tma, fill=impl == "torch")  # fmt: skip
    return _topk_fwd(logits, row_len, topk, out, impl, topk_tiling, split)
