"""Index ops of sparse MLA (DeepSeek V3.2 DSA, V4): top-k positions -> global slots, per-token top-k lengths,
dense rows -> the ragged ``(indptr, flat)`` form. All CUDA-graph safe with ``out=`` buffers (no host sync
unless ``validate=True`` outside a capture).

Conventions: a *slot* is ``block * block_size + offset`` in a paged cache; -1 marks an invalid entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.ops._validate import capturing, check_index, describe

__all__ = ["build_ragged_indices_from_dense", "convert_req_index_to_global_index", "sparse_seq_lens"]

_CONVERT_BLOCK_K = 128  # index entries per program of the conversion kernel
_SEQ_LENS_BLOCK_T = 128  # tokens per program of sparse_seq_lens
_RAGGED_BLOCK_R = 1024  # rows per step of the indptr scan
_RAGGED_BLOCK_W = 128  # entries per program of the ragged copy


def _check_out(name: str, buf, numel: int, dev, *, flat: bool = False) -> torch.Tensor:
    """A caller-provided int32 output buffer: contiguous, on ``dev``, at least ``numel`` entries; ``flat``: 1-D
    (the result is a slice of its first entries, which on a 2-D buffer would slice rows)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.int32 or not buf.is_contiguous() or buf.numel() < numel:
        raise ValueError(f"{name} must be a contiguous int32 tensor of >= {numel} entries; got {describe(buf)}")
    if flat and buf.dim() != 1:
        raise ValueError(f"{name} must be 1-D; got {describe(buf)}")
    if buf.device != dev:
        raise ValueError(f"{name} must be on {dev} like the other inputs; got {describe(buf)}")
    return buf


@triton.jit
def _convert_req_index_fwd_kernel(
    req_id,  # [T]
    block_table,  # [R, W]
    token_indices,  # [T, K]
    topk_length,  # [T] (HAS_LEN)
    out,  # [T, K] int32
    stride_bt_r,
    stride_bt_w,
    stride_ti_t,
    stride_ti_k,
    stride_o_t,
    R,
    W,
    K,
    block_size,
    HAS_LEN: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_k = tl.program_id(1)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    req = tl.load(req_id + i_t).to(tl.int64)
    n = K
    if HAS_LEN:
        n = tl.load(topk_length + i_t)
    tok = tl.load(token_indices + i_t * stride_ti_t + o_k * stride_ti_k, mask=m_k, other=-1).to(tl.int64)
    i_blk = tok // block_size
    # -1 (any negative position), a block beyond the table, a bad request row or an entry past the length: -1
    m_ok = m_k & (o_k < n) & (tok >= 0) & (i_blk < W) & (req >= 0) & (req < R)
    blk = tl.load(block_table + req * stride_bt_r + i_blk * stride_bt_w, mask=m_ok, other=-1).to(tl.int64)
    slot = tl.where(m_ok & (blk >= 0), blk * block_size + tok % block_size, -1)
    slot = tl.where(slot > 2147483647, -1, slot)  # past int32 (unchecked under validate=False): -1, never wrapped
    tl.store(out + i_t * stride_o_t + o_k, slot.to(tl.int32), mask=m_k)


def _check_slot_range(req_id, block_table, token_indices, topk_length, block_size: int) -> None:
    """Raise when a block the tokens select has slots past int32 (the output's dtype; the kernel would wrap them).
    Only the blocks actually selected count, so that garbage in unused block-table entries is allowed (host sync)."""
    R, W = block_table.shape
    K = token_indices.shape[1]
    if R == 0 or W == 0 or K == 0:
        return
    tok = token_indices.long()
    blk = torch.div(tok, block_size, rounding_mode="floor")
    used = (tok >= 0) & (blk < W)
    if topk_length is not None:
        used &= torch.arange(K, device=tok.device)[None, :] < topk_length.long()[:, None]
    rows = req_id.long()[:, None].expand_as(tok)
    picked = block_table[rows[used], blk[used]]
    if picked.numel() and (int(picked.max()) + 1) * block_size - 1 > 2**31 - 1:
        raise ValueError(f"block_table holds block {int(picked.max())}: its slots at block_size {block_size} "
                         "overflow the int32 output")  # fmt: skip


def convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    *,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    r"""Request-local top-k positions -> global cache slots (SPEC §6.3, dense FlashMLA form).

    ``out[t, j] = block_table[req_id[t], p // block_size] * block_size + p % block_size`` with
    ``p = token_indices[t, j]``. ``out[t, j] = -1`` where ``p < 0`` (the -1 padding of the top-k), where the
    block ``p // block_size`` lies beyond the table width ``W`` or holds a negative block number, and for
    ``j >= topk_length[t]``. Never reads outside ``block_table``.

    Args:
        req_id (torch.Tensor): `[T]`, int32/int64; each token's request row in ``block_table``.
        block_table (torch.Tensor): `[R, W]`, int32/int64, any strides.
        token_indices (torch.Tensor): `[T, K]`, int32/int64, any strides; request-local positions, -1 = none.
        block_size (int): tokens per cache block (>= 1).
        topk_length (torch.Tensor | None): `[T]`, int32/int64; only the first ``topk_length[t]`` entries
            count (the rest become -1).
        out (torch.Tensor | None): contiguous int32 `[T, K]` buffer (CUDA graphs).
        validate (bool): check ``req_id`` lies in ``[0, R)`` and that no selected slot overflows int32 (a host
            sync; skipped while capturing). Without it a bad request row or a slot past int32 gives -1 entries.

    Returns:
        torch.Tensor: `[T, K]` int32 global slots (-1 = invalid).
    """
    check_index("req_id", req_id, ndim=1)
    dev = req_id.device
    T = req_id.shape[0]
    check_index("block_table", block_table, ndim=2, device=dev)
    check_index("token_indices", token_indices, ndim=2, device=dev, length=T)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    if topk_length is not None:
        check_index("topk_length", topk_length, ndim=1, device=dev, length=T)
    K = token_indices.shape[1]
    R, W = block_table.shape
    if out is None:
        out = torch.empty(T, K, dtype=torch.int32, device=dev)
    else:
        _check_out("out", out, T * K, dev)
        if tuple(out.shape) != (T, K):
            raise ValueError(f"out must have shape [{T}, {K}]; got {describe(out)}")
    if validate and not capturing() and T:
        lo, hi = int(req_id.min()), int(req_id.max())
        if lo < 0 or hi >= R:
            raise ValueError(f"req_id holds {lo if lo < 0 else hi} but block_table has {R} rows")
        _check_slot_range(req_id, block_table, token_indices, topk_length, block_size)
    if T == 0 or K == 0:
        return out
    # the kernel reads one request row and one length per token from dense arrays (a strided one is copied)
    req_id = req_id.contiguous()
    topk_length = topk_length.contiguous() if topk_length is not None else None
    grid = (T, triton.cdiv(K, _CONVERT_BLOCK_K))
    _convert_req_index_fwd_kernel[grid](
        req_id, block_table, token_indices, topk_length if topk_length is not None else req_id, out,
        block_table.stride(0), block_table.stride(1), token_indices.stride(0), token_indices.stride(1),
        out.stride(0), R, W, K, block_size, HAS_LEN=topk_length is not None, BLOCK_K=_CONVERT_BLOCK_K,
    )  # fmt: skip
    return out


@triton.jit
def _sparse_seq_lens_fwd_kernel(
    query_start_loc,  # [B + 1]
    seq_lens,  # [B]
    out,  # [T] int32
    B,
    T,
    topk,
    LOG_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    # binary search: b = the number of requests that end at or before token t (query_start_loc is sorted)
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + B
    for _ in tl.static_range(LOG_B):
        mid = (lo + hi) // 2
        go = lo < hi
        end = tl.load(query_start_loc + mid + 1, mask=m_t & go, other=0)
        right = go & (end <= o_t)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(go & ~right, mid, hi)
    m_b = m_t & (lo < B)
    b = tl.where(m_b, lo, 0)
    q0 = tl.load(query_start_loc + b, mask=m_b, other=0)
    q1 = tl.load(query_start_loc + b + 1, mask=m_b, other=0)
    s = tl.load(seq_lens + b, mask=m_b, other=0)
    m_b = m_b & (o_t >= q0) & (s > 0)
    pos = s - (q1 - q0) + (o_t - q0)  # the token's absolute position
    n = tl.where(m_b, tl.minimum(tl.maximum(pos + 1, 0), topk), 0)
    tl.store(out + o_t, n.to(tl.int32), mask=m_t)


def sparse_seq_lens(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    *,
    num_tokens: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    r"""Keys each query token attends to under top-k selection: ``min(pos + 1, topk)`` (SPEC §6.2).

    Token ``t`` of request ``b`` (``query_start_loc[b] <= t < query_start_loc[b+1]``) sits at position
    ``pos = seq_lens[b] - qlen_b + (t - query_start_loc[b])``; its length is ``min(pos + 1, topk)`` (0 when
    ``pos < 0`` or ``seq_lens[b] == 0``). Tokens no request covers (CUDA-graph padding) get 0.

    Args:
        query_start_loc (torch.Tensor): `[B + 1]`, int32/int64, non-decreasing.
        seq_lens (torch.Tensor): `[B]`, int32/int64; context + new tokens.
        topk (int): the top-k width (>= 0).
        num_tokens (int | None): rows of the output; default ``query_start_loc[-1]`` (a host sync) or
            ``out``'s length.
        out (torch.Tensor | None): 1-D contiguous int32 buffer (CUDA graphs); its first ``num_tokens`` entries
            are written.
        validate (bool): check that ``query_start_loc`` is non-decreasing (a host sync; skipped while
            capturing).

    Returns:
        torch.Tensor: `[num_tokens]` int32.
    """
    check_index("query_start_loc", query_start_loc, ndim=1)
    dev = query_start_loc.device
    B = query_start_loc.shape[0] - 1
    if B < 0:
        raise ValueError(f"query_start_loc must have B + 1 >= 1 entries; got {describe(query_start_loc)}")
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
        raise ValueError(f"topk must be a non-negative int; got {topk!r}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; got {describe(t)}, strides {t.stride()}")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
        raise ValueError(f"num_tokens must be a non-negative int or None; got {num_tokens!r}")
    if out is not None:
        _check_out("out", out, 0 if num_tokens is None else num_tokens, dev, flat=True)
    if num_tokens is None:
        if out is not None:
            num_tokens = out.numel()
        elif capturing():
            raise ValueError("pass num_tokens or out while a CUDA graph is captured")
        else:
            num_tokens = int(query_start_loc[-1])
    if validate and not capturing() and B > 0 and bool((query_start_loc[1:] < query_start_loc[:-1]).any()):
        raise ValueError(f"query_start_loc must be non-decreasing; got {query_start_loc.tolist()}")
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    if num_tokens == 0:
        return out[:0]
    _sparse_seq_lens_fwd_kernel[(triton.cdiv(num_tokens, _SEQ_LENS_BLOCK_T),)](
        query_start_loc, seq_lens, out, B, num_tokens, topk,
        LOG_B=max(1, (B + 1).bit_length()), BLOCK_T=_SEQ_LENS_BLOCK_T,
    )  # fmt: skip
    return out[:num_tokens]


@triton.jit
def _ragged_indptr_fwd_kernel(
    lengths,  # [R]
    indptr,  # [R + 1] int32
    R,
    W,
    BLOCK_R: tl.constexpr,
):
    # one program scans all rows in blocks (a carried prefix sum)
    tl.store(indptr, 0)
    carry = tl.zeros([], dtype=tl.int64)
    for r0 in range(0, R, BLOCK_R):
        o_r = r0 + tl.arange(0, BLOCK_R)
        m_r = o_r < R
        n = tl.load(lengths + o_r, mask=m_r, other=0).to(tl.int64)
        n = tl.minimum(tl.maximum(n, 0), W)  # never copies past a row (validate=True refuses such lengths)
        c = tl.cumsum(n, axis=0) + carry
        tl.store(indptr + 1 + o_r, c.to(tl.int32), mask=m_r)
        carry += tl.sum(n, axis=0)


@triton.jit
def _ragged_copy_fwd_kernel(
    indices,  # [R, W]
    indptr,  # [R + 1] int32
    flat,  # [R * W] int32
    stride_i_r,
    stride_i_w,
    num_rows,
    HAS_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    start = tl.load(indptr + i_r).to(tl.int64)
    n = tl.load(indptr + i_r + 1).to(tl.int64) - start
    m_w = o_w < n
    v = tl.load(indices + i_r * stride_i_r + o_w * stride_i_w, mask=m_w, other=-1).to(tl.int64)
    if HAS_ROWS:
        v = tl.where((v >= 0) & (v < num_rows), v, -1)
    tl.store(flat + start + o_w, v.to(tl.int32), mask=m_w)


def build_ragged_indices_from_dense(
    indices: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_rows: int = -1,
    out_indptr: torch.Tensor | None = None,
    out_flat: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Dense index rows -> the ragged form ``(indptr, flat)`` (SPEC §7.5) that :func:`openmla.sparse_mla` takes.

    ``indptr = [0, cumsum(lengths)]`` and ``flat[indptr[r] + j] = indices[r, j]`` for ``j < lengths[r]``.
    With ``num_rows >= 0`` a value outside ``[0, num_rows)`` becomes -1. Note the order: the seed's function
    returns ``(flat, indptr)``; openmla returns ``(indptr, flat)``, the order ``sparse_mla(indices=...)`` takes.

    Args:
        indices (torch.Tensor): `[R, W]`, int32/int64, any strides.
        lengths (torch.Tensor): `[R]`, int32/int64, each in ``[0, W]``.
        num_rows (int): bound on the values (>= 0; -1: no bound).
        out_indptr (torch.Tensor | None): 1-D contiguous int32 buffer of >= ``R + 1`` entries.
        out_flat (torch.Tensor | None): 1-D contiguous int32 buffer of >= ``R * W`` entries (``R * W`` < 2^31).
        validate (bool): check that every length lies in ``[0, W]`` (a host sync; skipped while capturing).
            Without it the kernel clamps lengths to ``[0, W]`` so that nothing is read past a row.

    Returns:
        (indptr, flat): `[R + 1]` int32 and `[R * W]` int32 (capacity; entries past ``indptr[R]`` are
        unspecified).
    """
    check_index("indices", indices, ndim=2)
    dev = indices.device
    R, W = indices.shape
    check_index("lengths", lengths, ndim=1, device=dev, length=R)
    if isinstance(num_rows, bool) or not isinstance(num_rows, int):
        raise TypeError(f"num_rows must be an int; got {num_rows!r}")
    if num_rows < -1:  # -1 is the only "no bound"; any other negative value is a mistake, not a bound
        raise ValueError(f"num_rows must be >= 0, or -1 for no bound; got {num_rows}")
    if R * W > 2**31 - 1:  # indptr is int32: a larger total would wrap and the copy would write outside flat
        raise ValueError(f"indices has {R} x {W} entries, more than int32 indptr can address; got {describe(indices)}")
    if not lengths.is_contiguous():
        raise ValueError(f"lengths must be contiguous; got strides {lengths.stride()}")
    if validate and not capturing() and R:
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 0 or hi > W:
            raise ValueError(f"lengths must lie in [0, {W}] (the rows' width); got {lo if lo < 0 else hi}")
    indptr = torch.empty(R + 1, dtype=torch.int32, device=dev) if out_indptr is None else out_indptr
    flat = torch.empty(R * W, dtype=torch.int32, device=dev) if out_flat is None else out_flat
    if out_indptr is not None:
        _check_out("out_indptr", indptr, R + 1, dev, flat=True)
    if out_flat is not None:
        _check_out("out_flat", flat, R * W, dev, flat=True)
    _ragged_indptr_fwd_kernel[(1,)](lengths, indptr, R, W, BLOCK_R=_RAGGED_BLOCK_R)
    if R and W:
        _ragged_copy_fwd_kernel[(R, triton.cdiv(W, _RAGGED_BLOCK_W))](
            indices, indptr, flat, indices.stride(0), indices.stride(1), num_rows,
            HAS_ROWS=num_rows >= 0, BLOCK_W=_RAGGED_BLOCK_W,
        )  # fmt: skip
    return indptr[: R + 1], flat[: R * W]
