"""DCP decode routes for one rank's shard: plain, segmented verify and the global-position masked kernel.

Under DCP a rank holds only the keys it owns (``openmla.parallel.sharding``), at local positions. A causal
verify row ``t`` of request ``b`` (query length ``q``, global length ``S``) may see global positions
``[0, S - q + t]``; the plain causal mask of :func:`openmla.mla_decode` works in local positions and is
wrong there for ``W > 1``. Three routes give each row its exact local window (SPEC §5.6):

* **plain**: qlen 1 or a non-causal block; every row sees the whole local shard (``mla_decode``,
  ``causal=False``).
* **segmented**: one flattened request per verify row (qlen 1) whose local length is the sharded
  count of the row's global prefix (:func:`~openmla.parallel.sharding.dcp_local_verify_row_lens`), all
  rows of a request sharing its block table; the public ``mla_decode`` does the rest. It reads a
  request's KV once per row.
* **masked**: :func:`dcp_masked_decode`, a Triton kernel that maps each local key to its global position
  ``((l // I) * W + r) * I + l % I`` and masks ``g <= S - q + t``; one program streams (a split of) a
  request's KV once for all its rows (what AITER's round-robin "CPRR" kernel does); key splits are merged
  by LSE.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from openmla.device import compute_dtype
from openmla.ops._validate import FLOAT16_DTYPES, capturing, check_index, check_tensor, describe
from openmla.ops.cache import check_block_table
from openmla.ops.decode import _host_scale
from openmla.parallel.sharding import check_dcp_args

__all__ = ["dcp_masked_decode", "select_dcp_decode_route", "DCP_ROUTES"]

DCP_ROUTES = ("plain", "segmented", "masked")
_LOG2E = 1.4426950408889634


def select_dcp_decode_route(causal: bool, max_query_len: int, route: str | None = None) -> str:
    r"""Pick the DCP decode route of a batch (the analogue of vLLM's ``_select_dcp_decode_route``).

    Args:
        causal (bool): causal masking inside each request's query block.
        max_query_len (int): the batch's longest query (1 = plain decode).
        route (str | None): "auto" (default; also when None),
            "plain", "segmented" or "masked". A forced "segmented"/"masked" on a batch that needs no
            per-row window is honoured (both are exact there too); a forced "plain" on a causal verify
            batch is an error (it would let rows see future keys).

    Returns:
        str: "plain" for non-causal blocks and qlen <= 1; else "segmented". The masked kernel reads the shard
        once per request, but on the H200 it is slower at every shape measured (H128 b32 s131072: q2 23.6 ms
        against segmented's 3.9, q4 47.9 against 8.0; H16 q4 7.8 against 4.2), so it is only taken when forced.

    Raises:
        ValueError: an unknown route, or "plain" for a causal multi-row batch.
    """
    route = route or "auto"
    if route not in ("auto",) + DCP_ROUTES:
        raise ValueError(f'route must be "auto", "plain", "segmented" or "masked"; got {route!r}')
    needs_window = causal and max_query_len > 1
    if route == "plain" and needs_window:
        raise ValueError(f"route 'plain' cannot serve a causal verify batch (max_query_len {max_query_len})")
    if route != "auto":
        return route
    if not needs_window:
        return "plain"
    return "segmented"


def _check_query_rows(T: int, B: int, query_start_loc: torch.Tensor, max_query_len: int | None = None) -> int:
    """Check a batch's query rows on the host (a sync) and return its longest query.

    ``query_start_loc`` must rise from 0 to ``T`` (``T`` must be 0 for an empty batch: rows of no request
    would be left unwritten), and a ``max_query_len`` hint must bound every query (a smaller one would pick
    a route without the causal window, or leave rows of the masked kernel unwritten).
    """
    if not B:
        if T:
            raise ValueError(f"q has {T} rows but the batch has no request (block_table has 0 rows)")
        return 0
    qsl = query_start_loc.to(torch.int64).cpu()
    qlens = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or int(qsl[-1]) != T or bool((qlens < 0).any()):
        raise ValueError(f"query_start_loc must rise from 0 to q.shape[0] ({T}); got {qsl.tolist()}")
    top = int(qlens.max())
    if max_query_len is not None and top > max_query_len:
        raise ValueError(f"a request has {top} query rows but max_query_len is {max_query_len}")
    return top


def check_decode_batch(q, kv_cache, block_table, seq_lens, query_start_loc, sm_scale, kv_cache_dtype: str,
                       d_v: int) -> tuple[int, int, int, int]:  # fmt: skip
    """The shape, dtype and device checks of a (local) DCP decode's inputs (no sync); returns ``(T, H, d_qk, B)``."""
    check_tensor("q", q, dtypes=FLOAT16_DTYPES + (torch.float32,), ndim=3)
    dev = q.device
    T, H, d_qk = q.shape
    if d_qk <= d_v or d_v & (d_v - 1) or (d_qk - d_v) & (d_qk - d_v - 1):
        raise ValueError(f"q's last dim must be d_v ({d_v}) + a rope width, both powers of two; got {describe(q)}")
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f'kv_cache_dtype must be "auto" or "fp8"; got {kv_cache_dtype!r}')
    cache_dtypes = (torch.float8_e4m3fn,) if kv_cache_dtype == "fp8" else (q.dtype,)
    check_tensor("kv_cache", kv_cache, dtypes=cache_dtypes, ndim=3, device=dev)
    if kv_cache.shape[2] != d_qk:
        raise ValueError(f"kv_cache rows must be {d_qk} wide like q; got {describe(kv_cache)}")
    check_index("block_table", block_table, ndim=2, device=dev)
    B = block_table.shape[0]
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    check_index("query_start_loc", query_start_loc, ndim=1, device=dev, length=B + 1)
    if not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite float; got {sm_scale!r}")
    return T, H, d_qk, B


@triton.jit
def _local_count(n, RANK, WORLD, INTERLEAVE):
    """Keys of the global prefix ``[0, n)`` that rank ``RANK`` owns (n >= 0)."""
    base = n // (INTERLEAVE * WORLD) * INTERLEAVE
    return base + tl.minimum(tl.maximum(n - base * WORLD - RANK * INTERLEAVE, 0), INTERLEAVE)


@triton.jit
def _dcp_masked_decode_fwd_kernel(
    q,  # [T, H, D_V + D_R]
    kv_cache,  # [num_blocks, PAGE, D_V + D_R]
    block_table,  # [B, max_blocks], this rank's local blocks
    local_lens,  # [B] keys this rank holds per request
    global_lens,  # [B] global sequence lengths S
    query_start_loc,  # [B + 1]
    out,  # [T, H, D_V], or with SPLIT o_part [num_splits, T, H, D_V] fp32
    lse,  # [T, H] fp32, or with SPLIT lse_part [num_splits, T, H]
    scale_log2,  # sm_scale * kv_scale * log2(e)
    v_scale,  # kv_scale for an fp8 cache, else 1
    stride_q_t,
    stride_q_h,
    stride_kv_b,
    stride_kv_p,
    stride_bt_b,
    stride_o_t,
    stride_o_h,
    H,
    num_blocks,
    max_blocks,
    RANK,
    WORLD,
    INTERLEAVE,
    T,
    split_len,  # local keys per split (SPLIT)
    num_splits,  # key splits per (request, head block, row block); a runtime value: one compile for all counts
    SPLIT: tl.constexpr,  # num_splits > 1: write fp32 partials for the launcher's merge
    PAGE: tl.constexpr,
    D_V: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    Q_PER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_H * Q_PER
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_q = tl.program_id(2) // num_splits
    i_s = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_loc + i_b)
    qlen = tl.load(query_start_loc + i_b + 1) - q_start
    if i_q * Q_PER >= qlen:
        return
    L = tl.load(local_lens + i_b)
    S = tl.load(global_lens + i_b)
    o_m = tl.arange(0, BLOCK_M)
    o_t = i_q * Q_PER + o_m // BLOCK_H  # row within the request
    o_h = i_h * BLOCK_H + o_m % BLOCK_H
    m_m = (o_t < qlen) & (o_h < H)
    kv_hi = L
    if CAUSAL:
        last_g = S - qlen + o_t  # the last global position each row sees
        # the keys of the program's last row: a local prefix (owned positions grow with the local one)
        n_vis = tl.maximum(S - qlen + tl.minimum(i_q * Q_PER + Q_PER, qlen), 0)
        kv_hi = tl.minimum(L, _local_count(n_vis, RANK, WORLD, INTERLEAVE))

    o_c = tl.arange(0, D_V)
    o_r = tl.arange(0, D_R)
    p_q = q + (q_start + o_t).to(tl.int64)[:, None] * stride_q_t + o_h[:, None] * stride_q_h
    b_qc = tl.load(p_q + o_c[None, :], mask=m_m[:, None], other=0.0).to(COMPUTE)  # [M, D_V]
    b_qr = tl.load(p_q + D_V + o_r[None, :], mask=m_m[:, None], other=0.0).to(COMPUTE)  # [M, D_R]

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
    p_bt = block_table + i_b * stride_bt_b
    kv_lo = 0
    if SPLIT:
        kv_lo = i_s * split_len
        kv_hi = tl.minimum(kv_hi, kv_lo + split_len)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)  # local positions
        m_n = o_n < kv_hi
        i_blk = o_n // PAGE
        blk = tl.load(p_bt + i_blk, mask=m_n & (i_blk < max_blocks), other=-1).to(tl.int64)
        m_n = m_n & (blk >= 0) & (blk < num_blocks)
        p_kv = kv_cache + tl.where(m_n, blk * stride_kv_b + (o_n % PAGE) * stride_kv_p, 0)
        b_kc = tl.load(p_kv[:, None] + o_c[None, :], mask=m_n[:, None], other=0.0).to(COMPUTE)  # [N, D_V]
        b_kr = tl.load(p_kv[:, None] + D_V + o_r[None, :], mask=m_n[:, None], other=0.0).to(COMPUTE)  # [N, D_R]
        b_s = tl.dot(b_qc, tl.trans(b_kc), input_precision=DOT_PRECISION)
        b_s = tl.dot(b_qr, tl.trans(b_kr), b_s, input_precision=DOT_PRECISION)  # [M, N]
        m_s = m_n[None, :] & m_m[:, None]
        if CAUSAL:
            g = (o_n // INTERLEAVE * WORLD + RANK) * INTERLEAVE + o_n % INTERLEAVE  # global positions
            m_s = m_s & (g[None, :] <= last_g[:, None])
        b_s = tl.where(m_s, b_s * scale_log2, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_use)
        b_p = tl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = tl.dot(b_p.to(COMPUTE), b_kc, b_acc * b_alpha[:, None], input_precision=DOT_PRECISION)
        b_m = b_m_new

    empty = b_l == 0.0
    b_r = tl.where(empty, 0.0, v_scale / tl.where(empty, 1.0, b_l))
    b_lse = tl.where(empty, float("-inf"), (b_m + tl.log2(tl.where(empty, 1.0, b_l))) * 0.6931471805599453)
    row = (q_start + o_t).to(tl.int64)
    if SPLIT:  # this split's normalised partial; the launcher merges the splits by LSE
        row = row + i_s * T
    tl.store(lse + row * H + o_h, b_lse, mask=m_m)
    p_o = out + row[:, None] * stride_o_t + o_h[:, None] * stride_o_h + o_c[None, :]
    tl.store(p_o, (b_acc * b_r[:, None]).to(out.dtype.element_ty), mask=m_m[:, None])


def _num_splits(programs: int, max_local: int, device: torch.device) -> int:
    """Key splits per program so that about two waves of programs run (GPU only; 256+ keys a split)."""
    if device.type != "cuda" or programs == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-2 * sms // programs), -(-max_local // 256), 64))


def _merge_splits(o_part, lse_part, out, lse):
    """Exact LSE merge of `[S, T, H, D]` fp32 partials into ``out`` / ``lse`` (empty splits weigh 0)."""
    M = lse_part.amax(0)
    Ms = torch.where(torch.isneginf(M), 0.0, M)
    w = torch.exp(lse_part - Ms)  # [S, T, H]
    den = w.sum(0)
    safe = torch.where(den > 0, den, 1.0)
    out.copy_((torch.einsum("sth,sthd->thd", w, o_part) / safe[..., None]).to(out.dtype))
    lse.copy_(torch.where(den > 0, Ms + torch.log(safe), float("-inf")))


def _dcp_masked_decode_fwd(q, kv_cache, block_table, local_lens, global_lens, query_start_loc, out, lse,
                           scale_log2, v_scale, causal, d_v, max_query_len, world_size, rank, interleave,
                           num_splits=None):  # fmt: skip
    """Pick tiles and splits, launch the masked kernel (request x head block x (row block, split)), merge."""
    T, H, d_qk = q.shape
    B = block_table.shape[0]
    q_per = min(triton.next_power_of_2(max(max_query_len, 1)), 16)
    block_h = min(max(16 // q_per, 1), triton.next_power_of_2(H)) if q.device.type == "cpu" else max(16 // q_per, 1)
    block_n = 16 if kv_cache.element_size() == 4 else 32
    compute = compute_dtype(torch.float16 if kv_cache.dtype == torch.float8_e4m3fn else q.dtype)
    q_blocks = triton.cdiv(max(max_query_len, 1), q_per)
    max_local = block_table.shape[1] * kv_cache.shape[1]  # a bound on every local length, known on the host
    if num_splits is None:
        num_splits = _num_splits(B * triton.cdiv(H, block_h) * q_blocks, max_local, q.device)
    split_len = triton.cdiv(triton.cdiv(max_local, num_splits), block_n) * block_n
    o_dst, l_dst = out, lse
    if num_splits > 1:
        o_dst = torch.empty(num_splits, T, H, d_v, dtype=torch.float32, device=q.device)
        l_dst = torch.empty(num_splits, T, H, dtype=torch.float32, device=q.device)
    grid = (B, triton.cdiv(H, block_h), q_blocks * num_splits)
    _dcp_masked_decode_fwd_kernel[grid](
        q, kv_cache, block_table, local_lens, global_lens, query_start_loc, o_dst, l_dst, scale_log2, v_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        o_dst.stride(-3), o_dst.stride(-2), H, kv_cache.shape[0], block_table.shape[1], rank, world_size,
        interleave, T, split_len, num_splits, SPLIT=num_splits > 1, PAGE=kv_cache.shape[1], D_V=d_v, D_R=d_qk - d_v,
        BLOCK_H=block_h, Q_PER=q_per, BLOCK_N=block_n, CAUSAL=causal, COMPUTE=compute,
        DOT_PRECISION="ieee" if compute == tl.float32 else "tf32", num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits(o_dst, l_dst, out, lse)


def dcp_masked_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    world_size: int,
    rank: int,
    interleave: int = 1,
    causal: bool = True,
    kv_cache_dtype: str = "auto",
    kv_scale: torch.Tensor | float | None = None,
    max_query_len: int | None = None,
    d_v: int = 512,
    validate: bool = True,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One rank's partial MLA decode over its DCP shard, masked on global positions (no communication).

    Args:
        q (torch.Tensor): `[T, h, d_qk]` (576 = d_v + rope), bf16/fp16 (fp32 for tests).
        kv_cache (torch.Tensor): `[num_blocks, page_size, d_qk]`, q's dtype ("auto") or float8_e4m3fn ("fp8");
            this rank's shard at local positions.
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64; local blocks.
        seq_lens (torch.Tensor): `[B]`, int32/int64; **global** lengths ``S`` (local ones are derived).
        query_start_loc (torch.Tensor): `[B + 1]`, int32/int64; query lengths 0-16 (ragged allowed).
        sm_scale (float): softmax scale.
        world_size (int), rank (int), interleave (int): the sharding (``openmla.parallel.sharding``).
        causal (bool): row ``t`` of a request sees global positions ``[0, S - qlen + t]``; else all keys.
        kv_cache_dtype (str): "auto" or "fp8" (per-tensor ``kv_scale``, value = stored * kv_scale).
        max_query_len (int | None): the longest query (read from ``query_start_loc`` when None: a host sync).
        d_v (int): latent width (a power of two; 512 for DeepSeek).
        validate (bool): host-synchronising checks (lengths against the block table, ``query_start_loc``).
        num_splits (int | None): key splits per program, merged by LSE afterwards (default: 1 on CPU; on a
            GPU enough for about two waves of programs, from the block table's width, no host sync).

    Returns:
        out: `[T, h, d_v]`, q.dtype; the attention over this rank's visible keys (0 where none).
        lse: `[T, h]`, fp32, natural-log LSE of the scaled scores over those keys (-inf where none).

    Raises:
        TypeError, ValueError: bad dtypes, shapes, devices or sharding arguments (the message names them).
    """
    W, rank, I = check_dcp_args(world_size, rank, interleave)
    T, H, d_qk, B = check_decode_batch(q, kv_cache, block_table, seq_lens, query_start_loc, sm_scale,
                                       kv_cache_dtype, d_v)  # fmt: skip
    dev = q.device
    kv_s = 1.0
    if kv_cache_dtype == "fp8":  # positive and finite, a float or a 1-element tensor (read once on the host)
        kv_s = _host_scale("kv_scale", kv_scale, dev)
    elif kv_scale is not None:
        raise ValueError("kv_scale is only meaningful for an fp8 cache")
    # the kernel reads the index tensors as dense arrays (block_table rows through their row stride only)
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    from openmla.parallel.sharding import dcp_local_seq_lens

    sync_ok = validate and not capturing()
    local = dcp_local_seq_lens(seq_lens, W, rank, I, validate=sync_ok)
    if sync_ok:
        top = _check_query_rows(T, B, query_start_loc, max_query_len)
        if top > 16:
            raise ValueError(f"query lengths must be at most 16; got {top}")
        max_query_len = top if max_query_len is None else max_query_len
        if B:  # the local lengths covered by the local block table, whose blocks exist in the cache
            check_block_table(block_table, local, None, kv_cache.shape[1], kv_cache.shape[0])
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None; got {num_splits!r}")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if B else 0
    out = torch.empty(T, H, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T and B and H:
        _dcp_masked_decode_fwd(q, kv_cache, block_table, local, seq_lens, query_start_loc, out, lse,
                               sm_scale * kv_s * _LOG2E, kv_s, causal, d_v, max_query_len, W, rank, I,
                               num_splits)  # fmt: skip
    return out, lse
