"""Page-index expansion: a block table -> every token's flat slot (the page-size-1 view of a cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.ops._validate import capturing, check_index, describe

__all__ = ["expand_page_indices"]


@triton.jit
def _expand_page_indices_fwd_kernel(
    block_table,  # [B, W]
    kv_indptr,  # [B + 1] int32
    kv_indices,  # [capacity] int32
    stride_bt_b,
    stride_bt_w,
    max_blocks,
    capacity,
    block_size,
    BLOCK_T: tl.constexpr,
):
    # One program per (request, chunk of tokens): with one request a single program would otherwise
    # walk the whole sequence serially.
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    start = tl.load(kv_indptr + i_b).to(tl.int64)
    n = tl.load(kv_indptr + i_b + 1).to(tl.int64) - start
    if i_c * BLOCK_T >= n:
        return
    o_t = i_c * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    i_blk = o_t // block_size
    m_t = (o_t < n) & (i_blk < max_blocks) & (start + o_t >= 0) & (start + o_t < capacity)  # inside kv_indices
    blk = tl.load(block_table + i_b * stride_bt_b + i_blk * stride_bt_w, mask=m_t, other=-1).to(tl.int64)
    slot = tl.where(blk >= 0, blk * block_size + o_t % block_size, -1)
    slot = tl.where(slot <= 2147483647, slot, -1)  # a slot int32 cannot hold is -1, never a wrapped value
    tl.store(kv_indices + start + o_t, slot.to(tl.int32), mask=m_t)


def expand_page_indices(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    out_indptr: torch.Tensor | None = None,
    out_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Expand a block table into every token's flat slot, request after request.

    ``kv_indices[kv_indptr[b] + t] = block_table[b, t // block_size] * block_size + t % block_size``
    for ``t < seq_lens[b]``: the page-size-1 view of a paged cache (``cache.view(-1, entry)[slot]``).

    Args:
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64, any strides.
        seq_lens (torch.Tensor): `[B]`, int32/int64.
        block_size (int): tokens per cache block (any value >= 1).
        out_indptr (torch.Tensor | None): int32 buffer of at least `B + 1` entries. Entries past
            `B` are set to the total (padded requests of length 0, for CUDA graphs).
        out_indices (torch.Tensor | None): int32 buffer large enough for `sum(seq_lens)` slots; it is
            first filled with -1. With both buffers given nothing synchronises with the host.

    Raises:
        ValueError: negative ``seq_lens``, a request longer than its block table covers, or a slot past
            int32 (checked on the host unless a CUDA graph is being captured; unchecked, such a slot is
            written as -1, never wrapped).

    Returns:
        (kv_indptr, kv_indices): `[B + 1]` (or the given buffer) and `[sum(seq_lens)]` (or the given
        buffer), int32.
    """
    check_index("block_table", block_table, ndim=2)
    dev = block_table.device
    B, max_blocks = block_table.shape
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    if out_indptr is None:
        kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    else:
        if out_indptr.dtype != torch.int32 or out_indptr.dim() != 1 or out_indptr.shape[0] < B + 1:
            raise ValueError(f"out_indptr must be int32 [>= {B + 1}]; got {describe(out_indptr)}")
        if out_indptr.device != dev:
            raise ValueError(f"out_indptr must be on {dev}; got {describe(out_indptr)}")
        kv_indptr = out_indptr
        kv_indptr[:1].zero_()
    torch.cumsum(seq_lens, 0, dtype=torch.int32, out=kv_indptr[1 : B + 1])
    if kv_indptr.shape[0] > B + 1:
        kv_indptr[B + 1 :].copy_(kv_indptr[B].expand(kv_indptr.shape[0] - B - 1))

    sync_ok = not capturing()
    if sync_ok and B:
        if int(seq_lens.min()) < 0:
            raise ValueError("seq_lens must be non-negative")
        if int(seq_lens.max()) > max_blocks * block_size:
            raise ValueError(
                f"seq_lens reaches {int(seq_lens.max())} but block_table [{B}, {max_blocks}] covers "
                f"{max_blocks * block_size} tokens at block_size {block_size}"
            )
        # the largest slot any request reads must fit the int32 output
        need = (seq_lens.long() + block_size - 1) // block_size
        used = torch.arange(max_blocks, device=dev)[None, :] < need[:, None]
        top = int(block_table[used].max()) if bool(used.any()) else 0
        if (top + 1) * block_size - 1 > 2**31 - 1:
            raise ValueError(f"block_table holds block {top}: its slots at block_size {block_size} overflow int32")
    if out_indices is None:
        total = int(kv_indptr[B]) if B else 0
        kv_indices = torch.empty(total, dtype=torch.int32, device=dev)
    else:
        if out_indices.dtype != torch.int32 or out_indices.dim() != 1 or out_indices.device != dev:
            raise ValueError(f"out_indices must be a 1-D int32 tensor on {dev}; got {describe(out_indices)}")
        if sync_ok and B and int(kv_indptr[B]) > out_indices.shape[0]:
            raise ValueError(f"out_indices holds {out_indices.shape[0]} slots but sum(seq_lens) is {int(kv_indptr[B])}")
        kv_indices = out_indices
        kv_indices.fill_(-1)
    if B == 0 or kv_indices.numel() == 0:
        return kv_indptr, kv_indices
    BLOCK_T = 256
    grid = (B, triton.cdiv(max_blocks * block_size, BLOCK_T))
    _expand_page_indices_fwd_kernel[grid](
        block_table, kv_indptr, kv_indices, block_table.stride(0), block_table.stride(1), max_blocks,
        kv_indices.shape[0], block_size, BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return kv_indptr, kv_indices
